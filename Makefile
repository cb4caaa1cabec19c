# `make test`  : create .venv, install kvmem with its test extras, run the whole suite.
# `make serve` : create .venv, install kvmem, run `kvmem serve` (embedded CPU default).
# torch is installed first at TORCH_SPEC (the CPU build this project's CI uses); set
# TORCH_SPEC= (empty) to keep whatever torch the environment resolves for your machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: test serve bench proto clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q '$(TORCH_SPEC)')
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

serve: $(VENV)/.installed
	$(VENV)/bin/kvmem serve $(SERVE_ARGS)

bench: $(VENV)/.installed
	$(PY) bench/core_bench.py

proto: $(VENV)/.installed
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
