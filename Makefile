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

.PHONY: install test demo gpu-check gpu-wheels
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q

demo: $(VENV)/.installed
	$(VENV)/bin/layerwise demo

# `make gpu-check`: the GPU check (docs/benchmarks.md, "GPU check"), for a machine with one CUDA
# GPU, torch + transformers installed and no network. With CUDA it first installs layerwise
# without dependencies (and any wheels in $(WHEEL_DIR), e.g. highspy: `make gpu-wheels` here),
# then runs benchmarks/gpu_check.py, which writes $(GPU_CHECK_OUT) and prints it. Without CUDA it
# installs nothing, says there is no GPU and exits 0. Python: .venv's when present, else python3.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_OUT ?= gpu-check.json
GPU_CHECK_ARGS ?=
GPU_CHECK_TIMEOUT_S ?= 540
WHEEL_DIR ?= .whl
GPU_SITE ?= /tmp/layerwise-gpu-site
GPU_WHEELS ?= highspy==1.16.0

gpu-check:
	@if $(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  if ls $(WHEEL_DIR)/*.whl >/dev/null 2>&1; then \
	    $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	      --target $(GPU_SITE) $(WHEEL_DIR)/*.whl || echo "gpu-check: installing $(WHEEL_DIR)/*.whl failed"; \
	  fi; \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --no-build-isolation -e . \
	    || echo "gpu-check: editable install failed; running from src/ (PYTHONPATH)"; \
	fi; \
	PYTHONPATH=$(CURDIR)/src:$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	  timeout -k 15 $(GPU_CHECK_TIMEOUT_S) $(GPU_PY) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# Wheels the GPU machine lacks, for its Python 3.12 on x86-64 (it has no network); they travel
# to it only when the device call names $(WHEEL_DIR) in `carry` (the folder is git-ignored).
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $(WHEEL_DIR) $(GPU_WHEELS)
	@ls -l $(WHEEL_DIR)
