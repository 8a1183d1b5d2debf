#!/usr/bin/env bash
# The GPU device check, for the lent machine as it is: its own python3 (3.12, torch 2.11 CUDA 13, transformers,
# accelerate, peft, safetensors; no Ray, vLLM, Prefect, MLflow, datasets, math-verify), forge from this checkout,
# and the pure-Python wheels of scripts/gpu_wheels.txt carried in .gpu-wheels/ (`make gpu-wheels` here; the device
# tool's `carry: [".gpu-wheels"]`), unpacked into a temp dir on PYTHONPATH. Nothing is installed, nothing downloaded.
# The measurements (scripts/gpu_check.py: GRPO update, hf rollout, CUDA IPC publish, FSDP on one rank, checkpoint,
# and the Ray/vLLM path only where those import) each run under a time budget; the whole run <= 8 minutes.
# It writes gpu_check.json and gpu_check.md under $OUT (or --out DIR; else a temp dir, printed).
#
#   bash scripts/gpu_check.sh              # on the GPU machine (PYTHON=python3 by default); or: make gpu-check
#   bash scripts/gpu_check.sh --dry-run    # CPU, tiny shapes: the bare machine emulated (below); CI runs it
#
# --dry-run emulates the bare machine: a fresh venv (scripts/gpu_bare_venv.py) holding only the packages of
# scripts/gpu_machine_packages.txt, linked from $PYTHON's site-packages (default .venv/bin/python), with only this
# checkout and the carried wheels on PYTHONPATH; it fails if Ray/vLLM/Prefect/MLflow/... can be imported there, and
# any section that needs one of them fails as it would on the machine.
# Exit status: 0 when every section passed, 1 when one failed, 2 when the check could not start.
set -u
cd "$(dirname "$0")/.."
dry=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry=1; done
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "$dry" = 1 ]; then
  base="${PYTHON:-.venv/bin/python}"
  "$base" scripts/gpu_bare_venv.py "$work/venv" >/dev/null || exit 2
  PYTHON="$work/venv/bin/python" extra=(--bare)
else
  PYTHON="${PYTHON:-python3}" extra=()
fi

if ! ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  echo "gpu_check.sh: no wheels in .gpu-wheels/: run \`make gpu-wheels\` where a registry is reachable, and carry" \
       "the folder (the device tool's carry: [\".gpu-wheels\"])" >&2
  exit 2
fi
bytes=$(cat .gpu-wheels/*.whl | wc -c)
echo "gpu_check: wheel bundle .gpu-wheels: $(ls .gpu-wheels/*.whl | wc -l) wheels, $((bytes / 1024)) KiB" \
     "($(awk "BEGIN {printf \"%.2f\", $bytes / 1048576}") MiB; limit 60 MiB)"
[ "$bytes" -lt $((60 * 1024 * 1024)) ] || { echo "gpu_check.sh: the wheel bundle is over 60 MiB" >&2; exit 2; }
for whl in .gpu-wheels/*.whl; do
  "$PYTHON" -m zipfile -e "$whl" "$work/site" || exit 2
done

# the dry run's PYTHONPATH is exactly this (the emulation must not see the developer's); on the machine, extended
if [ "$dry" = 1 ]; then export PYTHONPATH="$PWD:$work/site"; else export PYTHONPATH="$PWD:$work/site${PYTHONPATH:+:$PYTHONPATH}"; fi
timeout 470 "$PYTHON" scripts/gpu_check.py "${extra[@]}" "$@"
status=$?
[ "$status" = 124 ] && echo "gpu_check.sh: stopped at its 470 s limit" >&2
exit $status
