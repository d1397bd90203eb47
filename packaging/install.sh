#!/bin/sh
# The one install sequence every tested path uses: `make install` (an editable checkout), the
# wheel test (tests/test_packaging.py: a fresh virtual environment, the built wheel) and the
# Dockerfile (the image's virtual environment, the same wheel).  What the wheel test proves about
# these commands is what the image runs.
#
#   PIP="PYTHON -m pip" sh packaging/install.sh REQUIREMENT...      (e.g. -e '.[test]', or a .whl)
#   PIP="PYTHON -m pip" sh packaging/install.sh --no-torch REQUIREMENT...
#
# --no-torch installs step 2 alone: what `duplexrt serve` needs for the echo and synthetic models
# (`make run`); no torch, no moshi.  Each step prints one line as it starts.
# 1. torch first, pinned: an unpinned request lets pip pick any build.  TORCH (default
#    torch==2.13.0) and TORCH_INDEX_URL (default: pip's own index; on Linux that is a CUDA build,
#    https://download.pytorch.org/whl/cpu gives the CPU one) choose it.  duplexrt needs torch only
#    for the moshi backend (its `moshi` extra asks torch>=2.4): `pip install duplexrt` alone
#    serves the echo and synthetic models without it.
# 2. The requirement(s) given: duplexrt itself.
# 3. The moshi package (the `moshi` backend: Moshi, Hibiki, the tiny test model).  It pins
#    torch<2.10 and numpy<2.3 but runs fine beside torch 2.13 and numpy 2.x, so it goes in
#    without its pins, after the light dependencies it really uses.
set -eu
: "${PIP:=python3 -m pip}"
: "${TORCH:=torch==2.13.0}"
with_torch=1 of=""
if [ "${1:-}" = "--no-torch" ]; then
    with_torch=0
    shift
else
    of="2/3 "
fi
step() { echo "install.sh: $*" >&2; }

if [ "$with_torch" = 1 ]; then
    step "1/3 $TORCH (a large download the first time: a minute or more)"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        $PIP install --quiet --index-url "$TORCH_INDEX_URL" "$TORCH"
    else
        $PIP install --quiet "$TORCH"
    fi
else
    step "torch and moshi skipped (--no-torch): the echo and synthetic models only"
fi
step "$of$* and its dependencies"
$PIP install --quiet "$@"
[ "$with_torch" = 1 ] || exit 0
step "3/3 moshi==0.2.13 and its light dependencies (the moshi backend)"
# The light dependencies before the package itself: pip checks what is installed against every
# pin after an install that resolves dependencies, and would print moshi's torch and numpy pins
# as red ERROR lines; the last step, --no-deps, checks nothing.
$PIP install --quiet 'safetensors>=0.4,<0.8' 'huggingface-hub>=0.24,<1.0' 'einops>=0.7,<0.9' \
    'sentencepiece>=0.2,<0.3' 'tqdm>=4.48'
$PIP install --quiet --no-deps moshi==0.2.13
