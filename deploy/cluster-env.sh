#!/usr/bin/env bash
# Environment for two DGX Sparks over ConnectX-7. Sourced by start-head.sh and
# start-worker.sh; edit the interface and HCA names to match `ibdev2netdev`.
#
# Each DGX Spark's ConnectX-7 shows up as two halves (two RoCE devices, two
# netdevs). NCCL must be given both in NCCL_IB_HCA or it uses only half the
# link. Keep NCCL and gloo (and Ray) on the ConnectX-7 netdev, not the
# management LAN.

# The ConnectX-7 netdev that carries the 200G link (see `ibdev2netdev`).
export DSPARK_CX7_IF="${DSPARK_CX7_IF:-enp1s0f0np0}"
# This box's address on that link.
export DSPARK_NODE_IP="${DSPARK_NODE_IP:-$(ip -4 -o addr show "$DSPARK_CX7_IF" 2>/dev/null | awk '{print $4}' | cut -d/ -f1)}"

export NCCL_SOCKET_IFNAME="$DSPARK_CX7_IF"
export GLOO_SOCKET_IFNAME="$DSPARK_CX7_IF"
export NCCL_IB_HCA="${NCCL_IB_HCA:-rocep1s0f0,roceP2p1s0f0}"   # both ConnectX-7 halves
export NCCL_IB_DISABLE=0
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Ray: object store sized for step batches (draft probabilities travel per step).
export DSPARK_OBJECT_STORE_BYTES="${DSPARK_OBJECT_STORE_BYTES:-8000000000}"

if [ -z "$DSPARK_NODE_IP" ]; then
  echo "cluster-env.sh: no IPv4 address on $DSPARK_CX7_IF; set DSPARK_CX7_IF or DSPARK_NODE_IP" >&2
  return 1 2>/dev/null || exit 1
fi
