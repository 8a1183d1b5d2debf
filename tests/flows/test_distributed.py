"""Distributed execution: stages attach to the run directory, and the result equals the in-process loop."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flows.distributed import drive, run_stage, stage_deployments
from flows.planning import plan_run
from forge.errors import UserError
from forge.presets import tiny
from forge.recipes.grpo import run


def _cfg():
    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.checkpoint.every = 4, 2, 2
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 8, 8
    cfg.pools = [
        {"name": "gen", "kind": "cpu", "work_pool": "wp-gen", "stages": ["rollout", "reward", "evaluate"]},
        {"name": "train", "kind": "cpu", "work_pool": "wp-train", "stages": ["update", "prep"]},
    ]
    return cfg


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def test_stage_by_stage_through_the_run_directory_equals_the_in_process_loop(tmp_path):
    cfg = _cfg()
    _, plan = plan_run(cfg)
    embedded = run(cfg, tmp_path / "embedded", progress=False, plan=plan)
    d = tmp_path / "staged"
    d.mkdir()
    summary = drive(cfg, d, plan, lambda stage, step: run_stage(d, stage, step))
    assert summary["execution"] == "distributed" and summary["steps"] == 4
    assert _metrics(d) == _metrics(tmp_path / "embedded")  # same rewards, losses, KL, eval, step by step
    assert summary["eval"] == embedded["eval"]
    a = load_file(tmp_path / "embedded" / "checkpoints" / "step-000004" / "model.safetensors")
    b = load_file(d / "checkpoints" / "step-000004" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    where = torch.load(d / "steps" / "step-000003" / "update.pt", weights_only=False)["where"]
    assert set(where) == {"host", "pid", "ppid"}
    assert json.loads((d / "status.json").read_text())["state"] == "finished"


def test_every_stage_needs_a_work_pool():
    cfg = _cfg()
    cfg.pools[1]["work_pool"] = ""
    _, plan = plan_run(cfg)
    with pytest.raises(UserError, match="pool 'train' \\(stage prep\\) has no work_pool"):
        stage_deployments(plan)
    cfg.pools[1]["work_pool"] = "wp-train"
    _, plan = plan_run(cfg)
    deployments = stage_deployments(plan)
    assert deployments["rollout"] == ("rollout-wp-gen", "wp-gen")
    assert deployments["checkpoint"] == ("checkpoint-wp-train", "wp-train")
