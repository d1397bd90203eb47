#!/usr/bin/env bash
# The wheel folder for a bare device machine: every package of benchmarks/gpu_wheels.txt as a
# wheel for CPython PYTHON_VERSION (default 3.12, the device machines') on x86-64 Linux, no
# dependencies (the machine has its own torch, numpy and the rest).  Run where pip reaches PyPI:
#
#   benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]
#
# then carry DIR to the device and run `benchmarks/gpu.sh --wheels DIR` there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?"usage: benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]"}
VERSION=${2:-3.12}
read -r -a PY <<< "${PYTHON:-python3}"
mapfile -t PACKAGES < <(grep -v '^#' benchmarks/gpu_wheels.txt | grep -v '^$')
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
"${PY[@]}" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" "${PACKAGES[@]}"
ls "$DIR"
