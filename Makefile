# One set-up for every target: .venv is created when missing, the package is
# installed (editable) with what the target needs, then the target runs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# On machines without a GPU the CPU build of torch is enough (and lies on disk
# on the development machines); override with `make test TORCH=torch` elsewhere.
TORCH  ?= torch==2.13.0
EXTRAS ?= test,torch,mesh,nvml,ray

.PHONY: all demo test test-gpu bench docs lint info clean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/managed-solve demo

info: $(VENV)/.installed
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
