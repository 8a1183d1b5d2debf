"""Stage retries (the Prefect runner's policy, `forge.stages.Stage.retry_safe`) are safe: an update is never retried,
a retried rollout samples the same batch again (none skipped, same result), a retried evaluation records its step
once; the workers are not rebuilt for a retry (no stage call builds them)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from forge.compose import local_workers
from forge.config import apply_overrides
from forge.presets import get_preset
from forge.recipes.grpo import run
from forge.stages import LocalStages, Stage
from forge.tracking import read_metrics

SETTINGS = ["steps=3", "threads=1", "checkpoint.every=1", "eval.every=0", "eval.k=0", "eval.max_problems=8",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "model.tiny.hidden=32", "model.tiny.layers=1",
            "tracking.mlflow=false"]  # fmt: skip


def retrying_runner(stage, step, fn, *args):
    """The Prefect runner's retry policy without Prefect: one retry for a stage safe to repeat."""
    try:
        return fn(*args)
    except RuntimeError:
        if not stage.retry_safe:
            raise
        return fn(*args)


class Flaky(LocalStages):
    """LocalStages whose rollout of step 2 and first evaluation each fail once (after doing their work)."""

    made: list = []
    failed: set = set()

    def __init__(self, cfg, run_dir, plan, micro_update):
        super().__init__(*local_workers(cfg, run_dir, micro_update))
        self.closed = False
        Flaky.made.append(self)

    def rollout(self, request):
        out = super().rollout(request)  # the work is done, then lost: as if the worker died before answering
        if request.step == 2 and "rollout" not in Flaky.failed:
            Flaky.failed.add("rollout")
            raise RuntimeError("rollout worker hiccup")
        return out

    def evaluate(self, rows, step, probe=False):
        if "evaluate" not in Flaky.failed:
            Flaky.failed.add("evaluate")
            raise RuntimeError("evaluate hiccup")
        return super().evaluate(rows, step, probe)

    def close(self):
        self.closed = True
        super().close()


def test_update_is_never_retried():
    assert [s for s in Stage if not s.retry_safe] == [Stage.UPDATE]


def test_retried_rollout_and_prepare_give_the_run_without_failures(tmp_path: Path):
    cfg = lambda: apply_overrides(get_preset("tiny"), SETTINGS).validate()  # noqa: E731
    run(cfg(), tmp_path / "plain", progress=False)
    Flaky.made, Flaky.failed = [], set()
    run(cfg(), tmp_path / "flaky", progress=False, stages=Flaky, runner=retrying_runner)
    assert Flaky.failed == {"rollout", "evaluate"}
    # the initial evaluation failed once and was retried on the same workers, which the run stopped at its end
    assert len(Flaky.made) == 1 and Flaky.made[0].closed
    a = load_file(tmp_path / "plain" / "checkpoints" / "step-000003" / "model.safetensors")
    b = load_file(tmp_path / "flaky" / "checkpoints" / "step-000003" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the retried rollout sampled the same batch, nothing skipped
    ra, rb = read_metrics(tmp_path / "plain" / "metrics.jsonl"), read_metrics(tmp_path / "flaky" / "metrics.jsonl")
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    assert [r["reward/mean"] for r in ra[1:]] == [r["reward/mean"] for r in rb[1:]]
    lines = (tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()
    assert sum('"step": 0' in line for line in lines) == 1  # the retried evaluation did not log step 0 twice
