# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use (CPU torch first, so pip does not fetch a CUDA build).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: install test demo
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q

demo: $(VENV)/.installed
	$(VENV)/bin/layerwise demo
