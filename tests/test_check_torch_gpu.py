"""`make setup`'s GPU check (scripts/check_torch_gpu.py) with a fake `nvidia-smi` on PATH and this machine's CPU torch:
GPUs that torch cannot see stop setup with one line naming the fix; no nvidia-smi, nothing to check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_torch_gpu.py"

HEADER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: {cuda}     |
+-----------------------------------------------------------------------------------------+"""


def _fake_smi(tmp_path: Path, gpus: int, cuda: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = "\\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d})" for i in range(gpus))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then printf "{listing}\\n"; else cat <<EOT\n'
                   f"{HEADER.format(cuda=cuda)}\nEOT\nfi\n")  # fmt: skip
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


def _check(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("cuda, names", [("12.8", "cu128"), ("13.0", "cu130"), ("12.4", "update the NVIDIA driver")])
def test_gpus_that_torch_does_not_see_stop_setup_with_one_line(tmp_path, cuda, names):
    import torch

    assert torch.version.cuda is None  # this machine's CPU torch: it never sees a GPU
    out = _check(_fake_smi(tmp_path, 2, cuda))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert (
        lines[0].startswith(f"make setup: nvidia-smi sees 2 GPUs (driver CUDA {cuda}) but torch") and names in lines[0]
    )


def test_cuda_tag_follows_the_driver(tmp_path):
    assert _check(_fake_smi(tmp_path, 1, "12.6"), "--cuda-tag").stdout.strip() == "cu126"


def test_no_nvidia_smi_means_nothing_to_check(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PATH": f"{empty}:/usr/bin:/bin"}
    if any((Path(d) / "nvidia-smi").exists() for d in env["PATH"].split(":")):
        pytest.skip("this machine has nvidia-smi")
    out = _check(env)
    assert out.returncode == 0 and out.stderr == ""
    assert _check(env, "--cuda-tag").stdout.strip() == ""


def test_make_setup_runs_the_check(tmp_path):
    # -o: the venv counts as installed (no pip run), so only the check runs
    env = _fake_smi(tmp_path, 1, "12.8")
    out = subprocess.run(["make", "-s", "-o", ".venv/.forgeweave-installed", "setup"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert "make setup: nvidia-smi sees 1 GPU (driver CUDA 12.8)" in out.stderr and "cu128" in out.stderr
