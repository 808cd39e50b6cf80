# Two commands on a fresh machine:  `make demo` (the embedded default) and `make test` (the test suite).
# Both create .venv on first use: CPU torch first (an unpinned torch would pull a multi-GB CUDA build), then
# this package with its dev extras. On a GPU machine, override: `make install TORCH="torch --index-url ..."`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PYTEST_ARGS ?= -q

.PHONY: install demo test

$(BIN)/trl-qerl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/trl-qerl

demo: install
	$(BIN)/trl-qerl demo

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)
