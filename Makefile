# One-command set-up on a fresh machine (Python 3.11): `make demo` runs the embedded end-to-end job,
# `make test` runs lint and the test suite. Both create .venv with a CPU build of torch first.
PY ?= python3
VENV := .venv
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: setup demo test lint
setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/fp4moe demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts

test: lint
	$(VENV)/bin/python -m pytest -q
