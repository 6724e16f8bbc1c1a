# One set-up for every target: .venv is created when missing, the package is
# installed (editable) with what the target needs, then the target runs.
# `make demo` needs only the package and matplotlib (for its picture); the
# test targets add what the tests import (torch, Ray, meshio, ...).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The tests need torch's CPU build only. On the project's development and CI
# machines the pinned version is a CPU build the package index serves; on an
# ordinary Linux machine pass the CPU index, so pip does not fetch the CUDA
# build: `make test TORCH_PIP="--index-url https://download.pytorch.org/whl/cpu"`.
TORCH       ?= torch==2.13.0
TORCH_PIP   ?=
EXTRAS      ?= test,torch,mesh,nvml,ray
DEMO_EXTRAS ?= plot

.PHONY: all demo test test-gpu bench docs lint info clean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e ".[$(DEMO_EXTRAS)]"
	touch $@

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH_PIP) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	$(BIN)/managed-solve demo

info: $(VENV)/.installed-demo
	$(BIN)/managed-solve info

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	@# The host-path tests again with two simulated GPUs in the default manager,
	@# as on a GPU machine: they must not depend on the machine's devices.
	MANAGED_SOLVE_SIMULATE=2x8GiB $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_solve.py tests/solvers

test-gpu: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "gpu or multi_gpu" $(PYTEST_ARGS)

bench: $(VENV)/.installed
	cd benchmarks && ../$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports

docs: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site
