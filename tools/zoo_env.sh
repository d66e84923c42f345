#!/usr/bin/env bash
# The optional zoo tier (tests/zoo) in one command: create its environment once, then run it.
#
#   tools/zoo_env.sh                 # create or reuse the env, then `pytest -m zoo tests/zoo -q`
#   tools/zoo_env.sh -k mmseg -x     # arguments go to pytest
#   ZOO_SETUP_ONLY=1 tools/zoo_env.sh  # create the env (and build mmcv) without running the tier
#
# The env is separate from the main one on purpose: it holds the index's CUDA builds of
# torch 2.14.1 / torchvision 0.29.1 (they run on a CPU-only host; about 6 GB), mmpretrain 1.2.0,
# mmsegmentation 1.2.2, mmdet 3.3.0 and mmcv 2.1.0 with its compiled ops. mmseg needs mmcv < 2.2 and imports
# mmcv.ops at module level, and no index has an mmcv wheel with ops for this torch: the mmcv 2.1.0
# sdist is built here once (its setup.py asks for -std=c++14/17, torch 2.14's headers need C++20,
# so the flag is patched), about 30 min on one core, and the wheel is kept for later envs.
#
# Variables:
#   MMFSDP_ZOO_VENV   the env (default: <repo>/.venv-zoo); reused when its marker matches
#   MMFSDP_ZOO_CACHE  where the built mmcv wheel is kept (default: ~/.cache/mmfsdp-zoo)
#   MAX_JOBS          parallel compile jobs of the one-time mmcv build (default: 1)
#   PYTHON            the interpreter that creates the env (default: python3)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MMFSDP_ZOO_VENV:-$REPO/.venv-zoo}
CACHE=${MMFSDP_ZOO_CACHE:-$HOME/.cache/mmfsdp-zoo}

TORCH=(torch==2.14.1 torchvision==0.29.1)
MMCV_VERSION=2.1.0
ZOO=(mmpretrain==1.2.0 mmsegmentation==1.2.2 mmdet==3.3.0
     # mmseg imports them (its text-prompt heads) without declaring them
     ftfy regex)
TRANSFORMERS='transformers==4.36.2'
# The marker records what the env was made with; a different spec rebuilds the installs.
SPEC="${TORCH[*]} mmcv==$MMCV_VERSION ${ZOO[*]} -e $REPO[tests] $TRANSFORMERS"
MARKER=$VENV/.mmfsdp-zoo-spec

log() { echo "[zoo_env] $*" >&2; }

# The mmcv wheel for this torch, built once from the sdist; prints its path.
mmcv_wheel() {
    local torch_version dir wheel src
    torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
    dir=$CACHE/mmcv-$MMCV_VERSION-torch-$torch_version-py$("$VENV/bin/python" -c \
        'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    wheel=$(ls "$dir"/mmcv-"$MMCV_VERSION"-*.whl 2>/dev/null | head -n1 || true)
    if [[ -n $wheel ]]; then
        log "reusing $wheel"
        echo "$wheel"
        return
    fi
    src=$(mktemp -d)
    log "building mmcv $MMCV_VERSION with ops (MAX_JOBS=${MAX_JOBS:-1}; ~30 min per core) in $src"
    # --no-build-isolation: setup.py imports torch, and the ops must match the env's torch.
    "$VENV/bin/pip" download -q --no-deps --no-build-isolation --no-binary :all: \
        "mmcv==$MMCV_VERSION" -d "$src" >&2
    tar -xzf "$src/mmcv-$MMCV_VERSION.tar.gz" -C "$src"
    sed -i 's/-std=c++1[47]/-std=c++20/g' "$src/mmcv-$MMCV_VERSION/setup.py"
    mkdir -p "$dir"
    MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-1} "$VENV/bin/pip" wheel -q --no-deps \
        --no-build-isolation -w "$dir" "$src/mmcv-$MMCV_VERSION" >&2
    rm -rf "$src"
    wheel=$(ls "$dir"/mmcv-"$MMCV_VERSION"-*.whl | head -n1)
    log "built $wheel"
    echo "$wheel"
}

if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if [[ ! -f $MARKER || $(cat "$MARKER") != "$SPEC" ]]; then
    # setuptools < 82: mmengine 0.10.7 imports pkg_resources; ninja speeds up the mmcv build.
    "$VENV/bin/pip" install -q "${TORCH[@]}" 'setuptools<82' wheel ninja
    WHEEL=$(mmcv_wheel)
    "$VENV/bin/pip" install -q "$WHEEL" "${ZOO[@]}" -e "$REPO[tests]"
    # Every `import mmpretrain.models` (mmdet's ReID preprocessor does one) imports its BLIP
    # code, which imports helpers later transformers dropped from modeling_utils (4.36.2 has
    # them); the tests extra's transformers 5 is for test_hf_zoo, which this tier does not run.
    "$VENV/bin/pip" install -q "$TRANSFORMERS"
    "$VENV/bin/python" -c 'import mmcv.ops, mmseg.models, mmdet.models, mmpretrain, mmfsdp'
    echo "$SPEC" > "$MARKER"
    log "environment ready: $VENV"
else
    log "reusing $VENV"
fi

if [[ -n ${ZOO_SETUP_ONLY:-} ]]; then
    exit 0
fi
cd "$REPO"
exec "$VENV/bin/python" -m pytest -m zoo tests/zoo -q "$@"
