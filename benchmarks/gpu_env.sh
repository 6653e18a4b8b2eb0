# Sourced by benchmarks/gpu_check.sh and experiments/gpu_sweep.sh: makes a bare GPU machine
# without network ready for psparse. Installs what its python lacks from the bundle's wheels
# (gpu-bundle/, made by `make gpu-bundle`) into a temporary target, points PSPARSE_DATA at the
# bundle's data and PSPARSE_CACHE at a writable folder, and checks the imports. Expects PYTHON
# and BUNDLE set, and the repository root as the working directory.
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
            --target "$site" $need || { echo "gpu setup: installing $need failed"; return 1 2>/dev/null || exit 1; }
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$BUNDLE/data" ]; then
    export PSPARSE_DATA=$(cd "$BUNDLE/data" && pwd)
fi
export PSPARSE_DATA=${PSPARSE_DATA:-$PWD/data}
# decoded CIFAR-10 goes to a cache folder of its own, never into the read-only bundle
export PSPARSE_CACHE=${PSPARSE_CACHE:-${HOME:-/tmp}/.cache/psparse}

if ! "$PYTHON" -c "import torch, numpy, msgpack, zmq" 2>/dev/null; then
    echo "gpu setup: $PYTHON lacks torch, numpy, msgpack or pyzmq; on a GPU machine without"
    echo "network copy gpu-bundle/ along (make gpu-bundle) -- see docs/notes/bench-gpu.md"
    return 1 2>/dev/null || exit 1
fi
