#!/usr/bin/env bash
# The GPU table in one call, on a bare device machine (its own python3 and torch, no network, no
# venv): installs the carried wheel folder OUTSIDE the output folder (a temporary folder, or
# GPU_SITE), then runs benchmarks/gpu.py with PYTHONPATH pointing there.  The output folder gets
# only the results (OUT/gpu.json, written early and after every phase): what a remote run brings
# back must stay a few small files.  A timeout of 8 minutes (GPU_TIMEOUT_S) and the phases' own
# limits keep it within the device's 10 minutes a command.
#
#   benchmarks/gpu_wheels.sh gpu-wheels     # first, on a machine with pip and PyPI (~19 MB)
#   benchmarks/gpu.sh --wheels gpu-wheels [OUT]
#   benchmarks/gpu.sh [OUT]                 # every package importable already (a dev venv)
#
# PYTHON (default python3) runs it.  Without CUDA the same phases run on the tiny model, as CI
# does (tests/test_gpu_script.py): a smoke test, not GPU figures.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=""
if [ "${1:-}" = "--wheels" ]; then
    WHEELS=${2:?"--wheels needs the wheel folder"}
    shift 2
fi
OUT=${1:-benchmark-gpu}
read -r -a PY <<< "${PYTHON:-python3}"
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
    ls "$WHEELS"/*.whl >/dev/null   # fails here, naming the folder, if it holds no wheel
    SITE=${GPU_SITE:-$(mktemp -d "${TMPDIR:-/tmp}/duplexrt-gpu-site.XXXXXX")}
    mkdir -p "$SITE"
    SITE="$(cd "$SITE" && pwd)"
    case "$SITE/" in
        "$(cd "$OUT" && pwd)/"*) echo "GPU_SITE ($SITE) is inside the output folder $OUT: give another" >&2; exit 2 ;;
    esac
    echo "installing $WHEELS into $SITE (outside $OUT)" >&2
    PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1 "${PY[@]}" -m pip install --quiet --no-index --no-deps \
        --no-compile --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# CUDA graphs are on unless the environment turns them off: say so if it does.
[ -n "${NO_CUDA_GRAPH:-}" ] && echo "warning: NO_CUDA_GRAPH is set: CUDA graphs are off" >&2
# Python's bytecode caches go elsewhere too (the checkout is what travels; OUT is what comes back).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-${TMPDIR:-/tmp}/duplexrt-gpu-pycache}
exec timeout "${GPU_TIMEOUT_S:-480}" "${PY[@]}" benchmarks/gpu.py --out "$OUT" --budget-s "${GPU_BUDGET_S:-450}"
