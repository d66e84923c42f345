#!/usr/bin/env bash
# Usage: [GPUS=8] [GPUS_PER_NODE=8] [CPUS_PER_TASK=5] [SRUN_ARGS=...] \
#     bash tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args...]
# The same knobs as tools/slurm_train.sh (GRES, PORT, MASTER_ADDR, PYTHON);
# every task runs tools/test.py --launcher slurm.
set -euo pipefail

PARTITION=$1
JOB_NAME=$2
CONFIG=$3
CHECKPOINT=$4
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
GRES=${GRES-gpu:${GPUS_PER_NODE}}
SRUN_ARGS=${SRUN_ARGS:-""}
export MASTER_PORT=${PORT:-${MASTER_PORT:-29500}}

# The CPU allocator of every process started here: jemalloc, else tcmalloc, where
# installed (MMFSDP_CPU_ALLOCATOR=glibc opts out; see tools/cpu_allocator.sh).
source "$(dirname "$0")/cpu_allocator.sh"

GRES_ARGS=()
[[ -n "$GRES" ]] && GRES_ARGS=(--gres="$GRES")

# SRUN_ARGS is split into words on purpose: it holds several options.
# shellcheck disable=SC2086
PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    "${GRES_ARGS[@]}" \
    --ntasks="$GPUS" \
    --ntasks-per-node="$GPUS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    $SRUN_ARGS \
    "${PYTHON:-python}" -u "$(dirname "$0")/test.py" \
    "$CONFIG" \
    "$CHECKPOINT" \
    --launcher slurm "${@:5}"
