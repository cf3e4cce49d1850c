# `make demo` and `make test` work on a fresh machine: they create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.slimtune-installed
DEMO_OUT ?= slimtune-demo

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel of torch lies on this machine's disk; an unpinned torch would pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/slimtune demo --out $(DEMO_OUT)

test: $(STAMP)
	$(BIN)/ruff check slimtune tests
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check slimtune tests bench

bench: $(STAMP)
	$(BIN)/python -m slimtune.bench save --preset llama3-8b --out bench-out

clean:
	rm -rf $(DEMO_OUT) bench-out .pytest_cache
