#!/usr/bin/env bash
# The GPU table in one call, on a bare device machine (its own python3 and torch, no network, no
# venv): installs the carried wheel folder into OUT/site, then runs benchmarks/gpu.py with
# PYTHONPATH pointing there.  The phases' limits and a 9-minute timeout keep it within the device's
# 10 minutes a command; the JSON (OUT/gpu.json) is written after every phase.
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
    SITE="$(cd "$OUT" && pwd)/site"
    PIP_ROOT_USER_ACTION=ignore "${PY[@]}" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# CUDA graphs are on unless the environment turns them off: say so if it does.
[ -n "${NO_CUDA_GRAPH:-}" ] && echo "warning: NO_CUDA_GRAPH is set: CUDA graphs are off" >&2
exec timeout "${GPU_TIMEOUT_S:-540}" "${PY[@]}" benchmarks/gpu.py --out "$OUT"
