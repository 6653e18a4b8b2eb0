#!/bin/bash
# The device check of psparse's GPU path, runnable on a bare GPU machine with no network.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]          # on the GPU machine (< 9 minutes)
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # CPU mode: the same steps with --device cpu
#
# It uses the machine's own python3 (PYTHON=... to choose another): torch, CuPy, numpy,
# msgpack and pytest must be there. What a bare GPU machine lacks travels in the folder
# gpu-bundle/ (make gpu-bundle; GPU_BUNDLE=... for another path): the pyzmq wheel, installed
# into a temporary target, and MNIST plus the CIFAR-10 archive, used as the data folder.
# The steps and the figures: benchmarks/gpu_check.py; how to run it: benchmarks/README.md.
# Writes gpu_check.json and the step logs to OUTDIR (default $OUT, else out-gpu).
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-gpu-bundle}
OUTDIR=${1:-${OUT:-out-gpu}}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"

if [ -d "$BUNDLE/wheels" ]; then
    site=$(mktemp -d /tmp/psparse-site-XXXXXX)
    # only what this python lacks: the bundle's wheels never replace an installed package
    need=$("$PYTHON" - "$BUNDLE/wheels" <<'EOF'
import importlib.util, pathlib, sys
names = {"pyzmq": "zmq", "msgpack": "msgpack", "pillow": "PIL"}
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    dist = wheel.name.split("-")[0].lower()
    if importlib.util.find_spec(names.get(dist, dist)) is None:
        print(wheel)
EOF
)
    if [ -n "$need" ]; then
        # shellcheck disable=SC2086
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$site" $need || { echo "gpu_check: installing $need failed"; exit 1; }
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$BUNDLE/data" ]; then
    export PSPARSE_DATA=$PWD/$BUNDLE/data
fi
export PSPARSE_DATA=${PSPARSE_DATA:-$PWD/data}
# decoded CIFAR-10 goes to a cache folder of its own, never into the read-only bundle
export PSPARSE_CACHE=${PSPARSE_CACHE:-${HOME:-/tmp}/.cache/psparse}

if ! "$PYTHON" -c "import torch, numpy, msgpack, zmq" 2>/dev/null; then
    echo "gpu_check: $PYTHON lacks torch, numpy, msgpack or pyzmq; on a GPU machine without"
    echo "network copy gpu-bundle/ along (make gpu-bundle) -- see benchmarks/README.md"
    exit 1
fi
if [ ! -e "$PSPARSE_DATA/mnist" ]; then
    echo "gpu_check: no MNIST in $PSPARSE_DATA (make gpu-bundle, or make data)"
    exit 1
fi
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUTDIR"  # GPU_CHECK_CPU=1: --cpu
