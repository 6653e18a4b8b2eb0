#!/bin/bash
# One prepared check of the GPU path on a machine with a CUDA device (< 8 minutes on one H200):
#   1. the GPU kernel tests (CuPy kernels against the numpy reference, tests/test_kernels.py),
#   2. benchmarks/gpu_select.py (selection vs torch.topk vs a device copy, CUDA events),
#   3. a 2-worker LeNet/MNIST run with --device cuda and --server-device cuda.
#
# The machine needs python3 with torch, CuPy, numpy and msgpack. What it lacks can travel as
# wheels in .whl/ (installed to /tmp/site, no network needed): `make gpu-wheels` fetches pyzmq's
# (for Python 3.12) into .whl/ on a machine that has network.
# MNIST must be in data/mnist (make data). Logs and the run's files go to $OUT (default out-gpu).
#
#   bash benchmarks/gpu_check.sh
set -u -o pipefail
OUT=${OUT:-out-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import cupy, torch, zmq; print('cupy', cupy.__version__, 'torch', torch.__version__,
'zmq', zmq.__version__, 'cuda', torch.cuda.is_available())" || exit 1

step "GPU kernel tests"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py \
    2>&1 | tee "$OUT/test_kernels.log" || status=1

step "selection benchmark"
timeout 180 python3 benchmarks/gpu_select.py 2>&1 | tee "$OUT/gpu_select.log" || status=1

step "2-worker LeNet/MNIST on the GPU (300 iterations, core, density 1%)"
timeout 150 python3 -m psparse.launch --workers 2 --device cuda --server-device cuda \
    --policy core --iterations 300 --eval-every 100 --out "$OUT/lenet-cuda" \
    2>&1 | tail -n 25 | tee "$OUT/lenet-cuda.log" || status=1
python3 - "$OUT/lenet-cuda" <<'EOF' || status=1
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
print({k: s[k] for k in ("status", "iterations_per_s", "union_over_k_mean", "test_acc")})
sys.exit(0 if s["status"] == "ok" and s["test_acc"] > 0.9 else 1)
EOF

step "done: status $status"
exit $status
