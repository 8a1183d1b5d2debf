#!/usr/bin/env python3
"""Does the installed torch see the GPUs the NVIDIA driver sees? (`make setup` runs this after installing.)

- no `nvidia-smi`, or it lists no GPU: nothing to check (a CPU machine), exit 0;
- torch sees them: exit 0;
- otherwise one line on stderr naming the fix (the torch CUDA build the driver can run), exit 1. This catches the
  silent failure where pip's default torch wheel is built for a newer CUDA than the driver supports (or is the CPU
  build): everything would run on the CPU, hundreds of times slower, without an error.

`--cuda-tag` prints the torch wheel variant the driver can run (cu130, cu128, cu126; empty without GPUs), for the
Makefile's TORCH_INDEX_BASE; it does not import torch. `--same-torch PYTHON PYTHON` (`make vllm-env`) checks that
two venvs hold one torch build (version, CUDA, NCCL), as the main venv's update ranks and the vLLM venv's engines
meet in one NCCL weight group; it asks each python, importing nothing itself. Uses only the standard library and
torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

# torch 2.13's CUDA wheel variants, newest first, with the CUDA version each needs the driver to support
CUDA_TAGS = (("cu130", (13, 0)), ("cu128", (12, 8)), ("cu126", (12, 6)))


def nvidia_smi() -> tuple[int, tuple[int, int] | None]:
    """(GPUs nvidia-smi lists, the CUDA version the driver supports or None); (0, None) without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, None
    try:
        listing = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
        header = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0, None
    gpus = sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header.stdout)
    return gpus, (int(match[1]), int(match[2])) if match else None


def cuda_tag(driver_cuda: tuple[int, int] | None) -> str:
    """The newest torch CUDA variant the driver runs ('' if it runs none or is unknown).

    >>> cuda_tag((12, 4)), cuda_tag((12, 8)), cuda_tag((13, 2)), cuda_tag(None)
    ('', 'cu128', 'cu130', '')
    """
    if driver_cuda is None:
        return ""
    return next((tag for tag, need in CUDA_TAGS if driver_cuda >= need), "")


def problem(gpus: int, driver_cuda: tuple[int, int] | None, torch_version: str, torch_cuda: str | None,
            torch_gpus: int) -> str:  # fmt: skip
    """The one-line error, or '' when torch sees the GPUs (or there are none)."""
    if gpus == 0 or torch_gpus > 0:
        return ""
    driver = f"{driver_cuda[0]}.{driver_cuda[1]}" if driver_cuda else "unknown"
    built = f"CUDA {torch_cuda}" if torch_cuda else "CPU only"
    tag = cuda_tag(driver_cuda)
    fix = (
        f"reinstall torch from PyTorch's {tag} wheel index: make clean-venv && make setup TORCH_INDEX_URL=<that "
        f"index> (or TORCH_INDEX_BASE=<PyTorch's wheel index root>, which picks {tag} from the driver)"
        if tag
        else f"the driver supports CUDA {driver}, older than any torch CUDA build ({CUDA_TAGS[-1][0]} needs 12.6): "
        "update the NVIDIA driver, then make clean-venv && make setup"
    )
    return (
        f"make setup: nvidia-smi sees {gpus} GPU{'s' if gpus > 1 else ''} (driver CUDA {driver}) but torch "
        f"{torch_version} ({built}) sees none: {fix}"
    )


BUILD = (
    "import torch\n"
    "try:\n    v = torch.cuda.nccl.version() if torch.version.cuda else 'none'\n"
    "    nccl = '.'.join(map(str, v)) if isinstance(v, tuple) else str(v)\n"
    "except Exception:\n    nccl = 'unknown'\n"
    "print('torch-build', torch.__version__.split('+')[0], torch.version.cuda or 'cpu', nccl)"
)


def torch_build(python: str) -> str:
    """`python`'s torch as 'torch VERSION (CUDA X, NCCL Y)' (the version without its local label: PyPI's CUDA
    wheel and an index's +cuXYZ wheel of one CUDA are one build), or why it has none."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        out = subprocess.run([python, "-c", BUILD], capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.SubprocessError) as e:
        return f"no torch ({type(e).__name__})"
    words = next((line.split() for line in out.stdout.splitlines() if line.startswith("torch-build ")), [])
    if len(words) != 4:
        return "no torch"
    return f"torch {words[1]} ({'CPU only' if words[2] == 'cpu' else 'CUDA ' + words[2]}, NCCL {words[3]})"


def same_torch(first: str, second: str) -> str:
    """The one-line error when the two pythons' torch builds differ (or one has none), else ''."""
    a, b = torch_build(first), torch_build(second)
    if a == b and not a.startswith("no torch"):
        return ""
    return (
        f"make vllm-env: {a} in {first} but {b} in {second}: the update ranks and the vLLM engines need one torch "
        "build (one NCCL weight group); make clean-venv, then make setup vllm-env with one TORCH_INDEX_URL or "
        "TORCH_INDEX_BASE"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--same-torch"] and len(argv) == 3:
        message = same_torch(argv[1], argv[2])
        if message:
            print(message, file=sys.stderr)
        return 1 if message else 0
    gpus, driver_cuda = nvidia_smi()
    if "--cuda-tag" in argv:
        print(cuda_tag(driver_cuda) if gpus else "")
        return 0
    if gpus == 0:
        return 0
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # the install is checked, not this shell's device mask
    import torch

    message = problem(gpus, driver_cuda, torch.__version__, torch.version.cuda, torch.cuda.device_count())
    if message:
        print(message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
