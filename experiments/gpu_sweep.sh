#!/bin/bash
# Runs of a sweep side by side on one GPU machine, within a time limit (a device lease is short):
#
#   bash experiments/gpu_sweep.sh SWEEP --only RUN,RUN --seconds 480 [--seeds 0]
#
# On a bare GPU machine with no network, with gpu-bundle/ copied along (make gpu-bundle). What
# it does and writes: python -m experiments.gpu_sweep --help.
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-gpu-bundle}
export PYTHONUNBUFFERED=1
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh || exit 1
exec "$PYTHON" -m experiments.gpu_sweep "$@"
