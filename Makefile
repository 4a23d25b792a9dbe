# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install cargohold, train the embedded demo
#   make test   create .venv, install cargohold with test extras, run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-test

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

test: install-test
	$(BIN)/python -m pytest -q
