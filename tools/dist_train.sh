#!/usr/bin/env bash
# Usage: bash tools/dist_train.sh CONFIG NPROC [train.py args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR and PORT on every node.
# PYTHON selects the interpreter (default: python on PATH).
set -euo pipefail

CONFIG=$1
NPROC=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
# One OpenMP / MKL thread per process unless set: what torchrun and mmengine
# would set anyway, without each process warning that they did.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}

# The CPU allocator of every process started here: jemalloc, else tcmalloc, where
# installed (MMFSDP_CPU_ALLOCATOR=glibc opts out; see tools/cpu_allocator.sh).
source "$(dirname "$0")/cpu_allocator.sh"

PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
"${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$NPROC" \
    --master_port="$PORT" \
    "$(dirname "$0")/train.py" \
    "$CONFIG" \
    --launcher pytorch "${@:3}"
