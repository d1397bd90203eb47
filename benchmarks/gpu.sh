#!/usr/bin/env bash
# Ready for a GPU: the step-time-by-batch table and --find-capacity for the real Moshi 7B
# architecture (seeded random weights built on the device: nothing to download), within 8 minutes.
#
#   benchmarks/gpu.sh [OUT_DIR]          # on a CUDA machine: configs/moshi-7b-random.toml
#
# Without CUDA it runs the same two steps on the tiny model with short probes, so that CI keeps
# the script working; those figures are no capacity figure.  Each step has its own time limit;
# the results (tables, JSON, the search's plot when matplotlib is there) go to OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-${OUT:-benchmark-gpu}}
mkdir -p "$OUT"

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    # CUDA graphs are on unless the environment turns them off: say so if it does.
    [ -n "${NO_CUDA_GRAPH:-}" ] && echo "warning: NO_CUDA_GRAPH is set: CUDA graphs are off" >&2
    CONFIG=configs/moshi-7b-random.toml
    TABLE=(--random moshi-7b --dtype bfloat16 --device cuda --sizes 1,2,4,8,16,32,64,128 --steps 20 --fixed-slots 0)
    TABLE_LIMIT=270
    SEARCH=(--probe-seconds 30)
    SEARCH_LIMIT=200
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), torch.__version__)"
else
    echo "no CUDA device: the tiny model on the CPU, short probes (a smoke test, not a capacity figure)"
    export NO_TORCH_COMPILE=1
    CONFIG=configs/moshi-tiny.toml
    TABLE=(--sizes 1,2,4 --steps 3 --fixed-slots 0 --device cpu)
    TABLE_LIMIT=120
    SEARCH=(--probe-seconds 2 --slots 4)
    SEARCH_LIMIT=120
fi

echo "== step time by batch size (one step of B rows, every row active)"
timeout "$TABLE_LIMIT" "$PY" benchmarks/moshi_tiny.py "${TABLE[@]}" --json "$OUT/steps.json" | tee "$OUT/steps.txt"

echo "== simulate --find-capacity ($CONFIG, paced 80 ms messages)"
PLOT=()
"$PY" -c "import matplotlib" 2>/dev/null && PLOT=(--plot "$OUT/capacity.png")
set +e
timeout "$SEARCH_LIMIT" "$PY" -m duplexrt_cli.app simulate --config "$CONFIG" --find-capacity --message-ms 80 \
    --no-progress --json "$OUT/capacity.json" "${PLOT[@]}" "${SEARCH[@]}" | tee "$OUT/capacity.txt"
status=${PIPESTATUS[0]}
set -e
# 1: the search ran and not even one session held (a slow CPU, or a model too big for the device).
if [ "$status" -eq 1 ]; then
    echo "note: not even one session held in real time on this machine"
elif [ "$status" -ne 0 ]; then
    echo "error: --find-capacity failed (exit status $status)" >&2
    exit "$status"
fi
