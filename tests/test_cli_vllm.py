"""`forgeweave run --set rollout.backend=vllm`: a real tiny run that learns with a vLLM engine, and no engine left
behind after the run or after a SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.cli import main
from tests.test_rollout_vllm import engine_pids

REPO = Path(__file__).resolve().parents[1]
# the tiny preset with vLLM's CPU attention's smallest head size; the step count is shortened but still learns clearly
VLLM_TINY = ["rollout.backend=vllm", "model.tiny_head_dim=32", "steps=120", "eval.every=60", "checkpoint.every=0"]


def _sets(settings):
    return [a for s in settings for a in ("--set", s)]


def test_tiny_preset_learns_with_vllm(runs_dir):
    """Seeded: greedy pass@1 on the 55 single-digit sums rises from ~0 by a clear margin, rollouts come from the
    engine at the trainer's policy version every step, weight sync is logged, and the engine is gone afterwards."""
    args = ["run", "--preset", "tiny", "--name", "v", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    assert main([*args, *_sets(VLLM_TINY)]) == 0
    run = runs_dir / "v"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["initial"]["pass@1"] < 0.1
    assert summary["eval"]["final"]["pass@1"] >= summary["eval"]["initial"]["pass@1"] + 0.2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["policy/version"] for r in steps] == [float(s) for s in range(1, 121)]
    syncs = [r["perf/weight_sync_s"] for r in steps]
    assert all(0 < s < 30 for s in syncs)
    assert (run / "logs" / "vllm-engine-0.log").is_file() and (run / "vllm-model" / "config.json").is_file()
    assert engine_pids(str(run)) == []


def test_sigterm_stops_the_engine(runs_dir):
    """SIGTERM while training: the run is marked failed and its engine process is stopped, not orphaned."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--name", "s", "--runs-dir", str(runs_dir)]
    cmd += ["--quiet", "--no-prefect", *_sets([*VLLM_TINY[:2], "steps=100000"])]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = runs_dir / "s" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:  # the engine serves and steps run
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert len(engine_pids(str(runs_dir / "s"))) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert engine_pids(str(runs_dir / "s")) == []
    assert json.loads((runs_dir / "s" / "status.json").read_text())["state"] == "failed"
