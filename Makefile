# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install cargohold, train the embedded demo
#   make test   create .venv, install cargohold with test extras, lint, run the test suite
# make lint: ruff (lint + format check) and mypy, zero findings (rules in pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow lint install install-test gpu-wheels gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so no dependency can pull a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .

install-test: $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'

demo: install
	$(BIN)/cargohold train --config examples/demo.yaml

# mypy resolves cargohold.* through a tree shaped like the installed package (package-dir:
# api/ is cargohold itself, beside it services/, cluster/ and proto/cargohold/v1/), built of
# links; static tools cannot follow setuptools' editable-install finder.
TYPECHECK := .typecheck/cargohold

lint: install-test
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	ln -s $(CURDIR)/api/*.py $(CURDIR)/services $(CURDIR)/cluster $(CURDIR)/proto/cargohold/v1 $(TYPECHECK)/
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

# The long variants (marked slow) that the default run leaves out; each has a fast test
# of the same behaviour in the default run.
test-slow: install-test
	$(BIN)/python -m pytest -q -m slow

# GPU checks (docs/benchmarks.md, "GPU"). A borrowed GPU machine has python3 with CUDA torch
# and no network: `make gpu-wheels` fetches here, into $(WHEELS) (ignored by git), what it
# lacks and cargohold's own wheel; there `make gpu-check` installs them beside that torch,
# builds cargohold from this tree in the same command (the carried wheel only where that
# build fails; gpu_check.py then refuses a wheel older than the tree) and runs the checks
# (<= 6 minutes).
GPU_PYTHON ?= python3
WHEELS ?= .whl
GPU_SITE ?= /tmp/cargohold-site
GPU_PIP := $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE)

gpu-wheels: install
	$(BIN)/python benchmarks/gpu_wheels.py $(WHEELS)

gpu-check:
	$(GPU_PIP) $(filter-out $(WHEELS)/cargohold-%,$(wildcard $(WHEELS)/*.whl))
	$(GPU_PIP) --no-build-isolation . || $(GPU_PIP) $(WHEELS)/cargohold-*.whl
	PYTHONPATH=$(GPU_SITE) $(GPU_PYTHON) benchmarks/gpu_check.py
