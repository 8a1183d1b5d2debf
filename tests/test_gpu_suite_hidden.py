"""tests/conftest.py hides GPUs unless FORGEWEAVE_GPU_TESTS=1: CPU tolerances and gloo two-rank tests stay on the
CPU on a GPU box; the tests under tests/gpu/ carry the `gpu` marker and are skipped without a GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_gpus_are_hidden_from_the_suite():
    assert os.environ.get("FORGEWEAVE_GPU_TESTS") == "1" or os.environ["CUDA_VISIBLE_DEVICES"] == ""
    if os.environ.get("FORGEWEAVE_GPU_TESTS") != "1":
        assert torch.cuda.device_count() == 0


def test_gpu_suite_is_collected_and_skipped_without_a_gpu_run():
    env = {k: v for k, v in os.environ.items() if k not in ("FORGEWEAVE_GPU_TESTS", "PYTEST_ADDOPTS")}
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
                          "-m", "gpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:]
    # -m gpu selects them: the marker is on every test under tests/gpu/
    count = (REPO / "tests" / "gpu" / "test_cuda_paths.py").read_text().count("\ndef test_")
    assert f"SKIPPED [{count}] tests/gpu/test_cuda_paths.py: needs a CUDA GPU and FORGEWEAVE_GPU_TESTS=1" in out.stdout
