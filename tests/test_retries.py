"""Stage retries (the Prefect runner's policy, `flows.pipeline.RETRY_SAFE`) are safe: an update is never retried, a
retried rollout samples the same batch again (none skipped, same result), a retried prepare stops the workers of the
failed attempt instead of leaking them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from flows.pipeline import RETRY_SAFE
from forge.config import apply_overrides
from forge.presets import get_preset
from forge.recipes.grpo import run
from forge.stages import LocalStages
from forge.tracking import read_metrics

SETTINGS = ["steps=3", "threads=1", "checkpoint.every=1", "eval.every=0", "eval.k=0", "eval.max_problems=8",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "model.tiny.hidden=32", "model.tiny.layers=1",
            "tracking.mlflow=false"]  # fmt: skip


def retrying_runner(stage, step, fn, *args):
    """The Prefect runner's retry policy without Prefect: one retry for a stage in RETRY_SAFE."""
    try:
        return fn(*args)
    except RuntimeError:
        if stage not in RETRY_SAFE:
            raise
        return fn(*args)


class Flaky(LocalStages):
    """LocalStages whose rollout of step 2 and first evaluation each fail once (after doing their work)."""

    made: list = []
    failed: set = set()

    def __init__(self, cfg, run_dir, plan=None):
        super().__init__(cfg, run_dir, plan)
        self.closed = False
        Flaky.made.append(self)

    def rollout(self, started):
        out = super().rollout(started)
        if started.step == 2 and "rollout" not in Flaky.failed:
            Flaky.failed.add("rollout")
            started.rollouts = None  # as if the worker died mid-call: nothing kept
            raise RuntimeError("rollout worker hiccup")
        return out

    def evaluate(self, rows, step):
        if "evaluate" not in Flaky.failed:
            Flaky.failed.add("evaluate")
            raise RuntimeError("evaluate hiccup")
        return super().evaluate(rows, step)

    def close(self):
        self.closed = True
        super().close()


def test_update_is_never_retried():
    assert "update" not in RETRY_SAFE and {"rollout", "reward", "prepare"} <= RETRY_SAFE


def test_retried_rollout_and_prepare_give_the_run_without_failures(tmp_path: Path):
    cfg = lambda: apply_overrides(get_preset("tiny"), SETTINGS).validate()  # noqa: E731
    run(cfg(), tmp_path / "plain", progress=False)
    Flaky.made, Flaky.failed = [], set()
    run(cfg(), tmp_path / "flaky", progress=False, stages=Flaky, runner=retrying_runner)
    assert Flaky.failed == {"rollout", "evaluate"}
    # the first prepare failed in its initial evaluation: its workers were stopped before the retry made new ones
    assert len(Flaky.made) == 2 and Flaky.made[0].closed
    a = load_file(tmp_path / "plain" / "checkpoints" / "step-000003" / "model.safetensors")
    b = load_file(tmp_path / "flaky" / "checkpoints" / "step-000003" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the retried rollout sampled the same batch, nothing skipped
    ra, rb = read_metrics(tmp_path / "plain" / "metrics.jsonl"), read_metrics(tmp_path / "flaky" / "metrics.jsonl")
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    assert [r["reward/mean"] for r in ra[1:]] == [r["reward/mean"] for r in rb[1:]]
    lines = (tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()
    assert sum('"step": 0' in line for line in lines) == 1  # the retried prepare did not log step 0 twice
