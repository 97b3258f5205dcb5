#!/usr/bin/env bash
# Box 2: join the head started by start-head.sh. Usage: start-worker.sh HEAD_IP
set -euo pipefail
cd "$(dirname "$0")/.."
head_ip="${1:?usage: start-worker.sh HEAD_IP (the head's ConnectX-7 address)}"
source deploy/cluster-env.sh
.venv/bin/ray start --address="$head_ip:6379" --node-ip-address="$DSPARK_NODE_IP" \
  --object-store-memory="$DSPARK_OBJECT_STORE_BYTES" --metrics-export-port=8080
