"""SIGKILL at 10 seeded random moments of a seeded tiny run, each followed by `--resume`: no step lost or recorded
twice in metrics.jsonl or the MLflow outbox, the same metrics and bit-for-bit the same final weights as an uninterrupted run.

The first kill lands at a random moment of the start (importing, preparing data, before the first checkpoint: the
resume starts it again from step 0); each later one a random fraction of a step after the run made progress
(mid-rollout, mid-update, mid-checkpoint write). Plain in-process execution (`--no-prefect`): a SIGKILL would orphan
an embedded Prefect server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from forge.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]
STEPS = 40  # room for 10 kills: packed updates made the tiny steps fast enough to finish 24 before the 10th
SETTINGS = [f"steps={STEPS}", "threads=1", "checkpoint.every=1", "eval.every=8", "eval.k=0", "eval.max_problems=8",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "model.tiny.hidden=32",
            "model.tiny.layers=1", "checkpoint.keep_last=2"]  # fmt: skip


def _cli(runs: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flows.cli", "run", "--runs-dir", str(runs), "--quiet", "--no-prefect", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _progress(run: Path) -> int:
    """Lines in metrics.jsonl (grows with every step and every checkpoint record)."""
    try:
        return len((run / "metrics.jsonl").read_bytes().splitlines())
    except OSError:
        return 0


def _wait_for_progress(proc: subprocess.Popen, run: Path, seen: int, timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if _progress(run) > seen:
            return True
        time.sleep(0.01)
    return False


def _train_rows(run: Path) -> list[dict]:
    """The step rows as written (not merged): one per step, never two."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward/mean" in r or r["step"] == 0]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "checkpoint/"))} for r in rows]


@pytest.mark.slow
def test_ten_sigkills_then_resume_match_the_uninterrupted_run(tmp_path):
    runs = tmp_path / "runs"
    # MLflow on, towards a server that is not there: every record stays in the run's outbox, which is checked below
    mlflow = ["tracking.mlflow=true", "tracking.uri=http://127.0.0.1:9", "tracking.finish_timeout_s=0"]
    sets = [a for s in SETTINGS + mlflow for a in ("--set", s)]
    straight = _cli(runs, "--preset", "tiny", "--name", "straight", *sets)
    assert straight.wait(timeout=300) == 0, straight.stderr.read()

    rng = np.random.default_rng(18)
    run = runs / "killed"
    kills = 0
    proc = _cli(runs, "--preset", "tiny", "--name", "killed", *sets)
    time.sleep(rng.uniform(0.5, 4.0))  # kill 1: somewhere in the start
    while kills < 10:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
        assert not (run / "summary.json").exists(), f"the run finished before kill {kills + 1}: make steps slower"
        first = not (run / "config.yaml").exists()
        args = ("--preset", "tiny", "--name", "killed", *sets) if first else ("--name", "killed", "--resume")
        proc = _cli(runs, *args)
        if kills == 10:
            break
        seen = _progress(run)
        if not _wait_for_progress(proc, run, seen):
            pytest.fail(f"no progress after resume {kills}: {proc.stderr.read() if proc.poll() is not None else ''}")
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment of the next step (or checkpoint write)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert kills == 10

    a = load_file(runs / "straight" / "checkpoints" / f"step-{STEPS:06d}" / "model.safetensors")
    b = load_file(run / "checkpoints" / f"step-{STEPS:06d}" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-6, k
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))  # none lost, none twice
    merged_a, merged_b = (
        _comparable(read_metrics(runs / "straight" / "metrics.jsonl")),
        _comparable(read_metrics(run / "metrics.jsonl")),
    )
    assert [r["step"] for r in merged_b] == list(range(STEPS + 1))
    for x, y in zip(merged_a, merged_b, strict=True):
        assert x.keys() == y.keys(), x["step"]
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (x["step"], k)
    samples = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == list(range(1, STEPS + 1)) and samples == sorted(samples)
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
    assert not list((run / "checkpoints").glob(".step-*"))  # killed saves' leftovers are cleaned
    outbox = [json.loads(line) for line in (run / "mlflow_outbox.jsonl").read_text().splitlines() if line.strip()]
    recorded = [r["step"] for r in outbox if r["op"] == "metrics" and any(k.startswith("reward") for k in r["metrics"])]
    assert sorted(recorded) == list(range(1, STEPS + 1))  # MLflow gets every step once, however often it was redone
