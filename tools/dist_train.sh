#!/usr/bin/env bash
# Usage: tools/dist_train.sh CONFIG GPUS [train.py args...]
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, PORT. Without CUDA the processes use gloo.
set -euo pipefail
CONFIG=$1
GPUS=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/venv_python.sh"

PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" \
"$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" \
    --master_port="$PORT" \
    "$HERE/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
