# One-command set-up on a fresh machine (Python 3.11): `make demo` runs the embedded end-to-end job,
# `make test` runs lint and the test suite. Both create .venv first, every package pinned by constraints.txt
# (pip-tools' compiled requirements: `make lock` regenerates it), torch as the CPU build.
PY ?= python3
VENV := .venv
TORCH ?= torch==2.13.0
# pytest-xdist workers for `make test` (auto: one per core)
JOBS ?= auto
PIP := $(VENV)/bin/pip install -q -c constraints.txt

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) $(TORCH)
	$(PIP) -e '.[test]'
	$(VENV)/bin/pip check
	touch $@

.PHONY: setup demo test lint lock gpu-test gpu-verify
setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/fp4moe demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts

test: lint
	$(VENV)/bin/python -m pytest -q -n $(JOBS) --dist worksteal --durations=25

# constraints.txt from pyproject.toml and requirements/lock.in (needs the package index)
lock:
	scripts/lock.sh

# on the GPU machine (no network): the carried wheels (scripts/gpu_wheels.sh) and every GPU test
gpu-test:
	scripts/gpu_test.sh

# on the GPU machine: the GPU tests and every benchmark behind BENCHMARKS.md's current table, one stage per
# device call (STAGES: kernels, kernels2, marked, runner, spec, server, engine, served; tests = marked runner
# spec server; all; each under 9.5 min), results with provenance in $OUT
STAGES ?= all
gpu-verify:
	benchmarks/verify_gpu.sh $(STAGES)
