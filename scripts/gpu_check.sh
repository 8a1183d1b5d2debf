#!/usr/bin/env bash
# The GPU device check: the `gpu` test suite (tests/gpu) and the measurements of scripts/gpu_check.py, on one CUDA GPU,
# with the machine's torch / transformers / accelerate (+ ray, and vLLM if there, for `ray`; nothing to install).
# Budget: <= 10 minutes on one H200 (each part is bounded by `timeout`). Never run on a GPU yet. Its `wgroup` section
# checks the weight group (forge/weight_group.py) on the one GPU: NCCL refuses two ranks on one device, so a sender on
# cuda:0 (bf16 cast and bucket packing on the device) broadcasts to a receiver process on the same GPU over gloo with
# CUDA buckets, which must match bit for bit; a single-rank NCCL group times the NCCL send; the old host-copy path is
# timed beside it at the same shape (Qwen2.5-0.5B), with the sender's peak extra device and host memory. Its `ray`
# section (run on its own, after the others, with a budget of its own) starts a private Ray on 127.0.0.1 and trains the
# tiny preset for 3 steps in Ray mode with update and rollout colocated on the one GPU: a vLLM engine when the vLLM venv
# exists (.venv-vllm, or $VLLM_PYTHON; needs ray in $PYTHON too), weights by CUDA IPC handles, the engine's level-2
# sleep and wake, the trainer's release of its memory; it prints seconds per sync and peak GPU memory per actor.
# Run from the repository root:
#   bash scripts/gpu_check.sh              # or: make gpu-check  (GPU_PYTHON=... to pick the python)
#   bash scripts/gpu_check.sh --dry-run    # CPU smoke run of the measurement script (tiny shapes, gloo)
# Exit status: 0 when every part passed.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0

if [ "${1:-}" = "--dry-run" ]; then
  exec timeout 900 "$PYTHON" scripts/gpu_check.py --dry-run
fi

"$PYTHON" - <<'PY' || exit 2
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device, nothing to check (--dry-run runs a CPU smoke test)")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})")
PY

if "$PYTHON" -c "import pytest" 2>/dev/null; then
  echo "== gpu test suite (tests/gpu)"
  FORGEWEAVE_GPU_TESTS=1 timeout 120 "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" -rs || status=1
else
  echo "== gpu test suite: pytest is not installed here; skipped (the measurements below still run)"
fi

echo "== measurements (scripts/gpu_check.py)"
timeout 300 "$PYTHON" scripts/gpu_check.py --skip ray || status=1
echo "== Ray, colocated (scripts/gpu_check.py --only ray)"
if "$PYTHON" -c "import ray" 2>/dev/null; then
  timeout 180 "$PYTHON" scripts/gpu_check.py --only ray || status=1
else
  echo "ray: ray is not installed in $PYTHON; the colocated Ray check did not run"; status=1
fi
echo "gpu_check.sh: exit $status"
exit $status
