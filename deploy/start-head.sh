#!/usr/bin/env bash
# Box 1: start the Ray head on the ConnectX-7 address. Then run
#   .venv/bin/serve run deploy/dspark-2x-spark.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/cluster-env.sh
.venv/bin/ray start --head --node-ip-address="$DSPARK_NODE_IP" --port=6379 \
  --dashboard-host=127.0.0.1 --object-store-memory="$DSPARK_OBJECT_STORE_BYTES" \
  --metrics-export-port=8080
echo "head up at $DSPARK_NODE_IP:6379; on box 2 run: bash deploy/start-worker.sh $DSPARK_NODE_IP"
