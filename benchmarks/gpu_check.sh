#!/bin/bash
# The device check of psparse's GPU path, runnable on a bare GPU machine with no network.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]          # on the GPU machine (< 9 minutes)
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # CPU mode: the same steps with --device cpu
#   GPU_CHECK_BUDGET=400 bash benchmarks/gpu_check.sh  # a shorter budget (default 510 s)
#
# It uses the machine's own python3 (PYTHON=... to choose another): torch, CuPy, numpy,
# msgpack and pytest must be there. What a bare GPU machine lacks travels in the folder
# gpu-bundle/ (make gpu-bundle; GPU_BUNDLE=... for another path): the pyzmq wheel, installed
# into a temporary target, and MNIST plus the CIFAR-10 archive, used as the data folder.
# The steps and the figures: benchmarks/gpu_check.py; how to run it: docs/notes/bench-gpu.md.
# Writes gpu_check.json and the step logs to OUTDIR (default $OUT, else out-gpu).
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-gpu-bundle}
OUTDIR=${1:-${OUT:-out-gpu}}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"

# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh || exit 1
if [ ! -e "$PSPARSE_DATA/mnist" ]; then
    echo "gpu_check: no MNIST in $PSPARSE_DATA (make gpu-bundle, or make data)"
    exit 1
fi
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUTDIR"  # GPU_CHECK_CPU=1: --cpu
