"""Served deployments read and write only inside the served runs directory (a UI user fills their parameters)."""

from __future__ import annotations

import pytest

from flows.deployments import SERVED_RUNS_DIR, confined
from flows.pipeline import evaluate_checkpoint, grpo_pipeline, prepare_dataset
from forge.errors import UserError


@pytest.fixture
def served(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv(SERVED_RUNS_DIR, str(runs))
    return runs


@pytest.mark.parametrize(
    "call",
    [
        lambda out: grpo_pipeline.fn(preset="tiny", runs_dir=str(out)),
        lambda out: grpo_pipeline.fn(preset="tiny", config_path=str(out / "cfg.yaml")),
        lambda out: evaluate_checkpoint.fn(checkpoint=str(out)),
        lambda out: prepare_dataset.fn(out_dir=str(out)),
        lambda out: prepare_dataset.fn(out_dir="../elsewhere"),
    ],
    ids=["runs_dir", "config_path", "checkpoint", "out_dir", "dotdot"],
)
def test_a_path_outside_the_served_runs_dir_is_refused_before_anything_is_written(served, tmp_path, call):
    outside = tmp_path / "elsewhere"
    with pytest.raises(UserError, match="outside the served runs directory"):
        call(outside)
    assert not outside.exists()
    assert list(served.iterdir()) == []


def test_a_symlink_out_of_the_runs_dir_is_refused_and_paths_inside_resolve(served, tmp_path):
    (served / "escape").symlink_to(tmp_path)
    with pytest.raises(UserError, match="parameter checkpoint="):
        confined("escape/ckpt", "checkpoint")
    assert confined("run-a/checkpoints/step-000002", "checkpoint") == str(served / "run-a/checkpoints/step-000002")
    assert confined(str(served / "run-a"), "runs_dir") == str(served / "run-a")


def test_outside_a_served_deployment_any_path_is_taken(monkeypatch, tmp_path):
    monkeypatch.delenv(SERVED_RUNS_DIR, raising=False)
    assert confined(str(tmp_path / "x"), "out_dir") == str(tmp_path / "x")
