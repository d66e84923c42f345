#!/usr/bin/env bash
# One tier of the suite under a given torch, in that torch's own environment (created once).
#
#   tools/test_torch.sh 2.15.0 unit      # tests/unit: every compat/ guard, no process (~2 min)
#   tools/test_torch.sh 2.15.0 smoke     # the dist smoke (-m smoke): every compat/ entry at work
#   tools/test_torch.sh 2.14.1 all       # the README's suite (pytest -q)
#   tools/test_torch.sh 2.15.0 unit -k compat -x   # further arguments go to pytest
#
# The env is <repo>/.venv-torch<VERSION> (MMFSDP_TORCH_VENV overrides): torch and mmfsdp editable
# with its tests extra. Its marker records what it was made with, so a second run only runs the
# tier. A torch without a CPU build on the index
# is its CUDA build (several GB; it runs on a CPU-only host). PIP_CONSTRAINT=/dev/null lifts a
# constraint file a pip config may set (one capping torch below the version asked for); the
# README's own commands never pull a CUDA torch. The tested versions: mmfsdp/compat/version.py.
#
# Variables: MMFSDP_TORCH_VENV (the env), PYTHON (the interpreter that creates it, default python3).
set -euo pipefail

usage() { echo "usage: $0 TORCH_VERSION unit|smoke|all [pytest arguments]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
VERSION=$1 TIER=$2
shift 2
case $TIER in
    unit) TARGET=(tests/unit) ;;
    smoke) TARGET=(-m smoke tests/dist) ;;
    all) TARGET=() ;;
    *) usage ;;
esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MMFSDP_TORCH_VENV:-$REPO/.venv-torch$VERSION}
SPEC="torch==$VERSION -e $REPO[tests]"
MARKER=$VENV/.mmfsdp-torch-spec

if [[ ! -f $MARKER || $(cat "$MARKER") != "$SPEC" ]]; then
    echo "[test_torch] creating $VENV: $SPEC" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
    PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q "torch==$VERSION" -e "$REPO[tests]"
    echo "$SPEC" > "$MARKER"
fi
cd "$REPO"
"$VENV/bin/python" -c 'import torch, mmengine, mmfsdp
print(f"[test_torch] torch {torch.__version__}, mmengine {mmengine.__version__}, mmfsdp from "
      f"{mmfsdp.__file__}")' >&2
exec "$VENV/bin/python" -m pytest -q "${TARGET[@]}" "$@"
