#!/usr/bin/env bash
# Usage: [GPUS=8] [GPUS_PER_NODE=8] [CPUS_PER_TASK=5] [SRUN_ARGS=...] \
#     tools/slurm_train.sh PARTITION JOB_NAME CONFIG WORK_DIR [train.py args...]
# The upstream OpenMMLab script: one srun task per GPU, tools/train.py --launcher slurm.
# PYTHON picks the interpreter (default: the environment tools/setup_env.sh builds, see
# venv_python.sh; the compute nodes must see the same path).
set -euo pipefail
if [ "$#" -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG WORK_DIR [train.py args...]" >&2
    exit 2
fi
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
WORK_DIR=$4
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/venv_python.sh"

set -x
# SRUN_ARGS is split on spaces on purpose: it holds several srun options.
# shellcheck disable=SC2086
PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}" \
srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    --gres=gpu:"$GPUS_PER_NODE" \
    --ntasks="$GPUS" \
    --ntasks-per-node="$GPUS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    ${SRUN_ARGS} \
    "$PYTHON" -u "$HERE/train.py" "$CONFIG" --work-dir="$WORK_DIR" --launcher="slurm" "${@:5}"
