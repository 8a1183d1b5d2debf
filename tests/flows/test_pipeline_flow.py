"""The pipeline as a Prefect flow in embedded mode: a flow run, and one task run per stage per step, in the API."""

import asyncio
import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.cli import main
from flows.pipeline import artifact_key, eval_markdown

SHORT = ["--set", "steps=4", "--set", "eval.every=2", "--set", "checkpoint.every=2", "--set", "eval.k=0"]


async def _flow_and_task_runs(flow_run_id: str):
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        artifacts = await client.read_artifacts()
    return flow_run, tasks, artifacts


def test_run_is_a_prefect_flow_with_a_task_run_per_stage_per_step(runs_dir):
    assert main(["run", "--preset", "tiny", "--name", "pf", "--runs-dir", str(runs_dir), "--quiet", *SHORT]) == 0
    summary = json.loads((runs_dir / "pf" / "summary.json").read_text())
    flow_run, tasks, artifacts = asyncio.run(_flow_and_task_runs(summary["prefect_flow_run_id"]))
    assert flow_run.state.is_completed() and flow_run.flow_id
    names = {t.name: t for t in tasks}
    expected = {"prepare-000000", "evaluate-000000"}  # the initial evaluation is a stage of its own
    for step in range(1, 5):
        expected |= {f"rollout-{step:06d}", f"reward-{step:06d}", f"update-{step:06d}"}
    expected |= {"evaluate-000002", "evaluate-000004", "checkpoint-000002", "checkpoint-000004"}
    assert expected <= set(names), expected - set(names)
    assert all(names[n].state.is_completed() for n in expected)
    assert summary["prefect_task_runs"] == len(expected)
    assert any(a.key == artifact_key("pf") and "pass@1" in (a.data or "") for a in artifacts)
    plan = json.loads((runs_dir / "pf" / "plan.json").read_text())
    assert {a["stage"] for a in plan["assignments"]} == {"prep", "rollout", "reward", "update", "evaluate"}


def test_no_prefect_path_writes_the_same_contract(runs_dir):
    args = ["run", "--preset", "tiny", "--name", "plain", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    assert main(args + SHORT) == 0
    summary = json.loads((runs_dir / "plain" / "summary.json").read_text())
    assert "prefect_flow_run_id" not in summary and summary["steps"] == 4
    assert (runs_dir / "plain" / "plan.json").is_file()


def test_eval_markdown_is_a_table():
    md = eval_markdown("r", {"step": 3, "pass@1": 0.5, "pass@4": 0.75, "problems": 10, "seconds": 1.0})
    assert "| pass@1 | 0.5000 |" in md and "| pass@4 | 0.7500 |" in md
    assert artifact_key("My_Run 1") == "eval-my-run-1"


@pytest.mark.parametrize("stage,tries", [("reward", 3), ("update", 1)])
def test_a_stage_that_keeps_failing_fails_the_flow_with_its_own_error(runs_dir, monkeypatch, stage, tries):
    """A stage safe to repeat (reward) is retried orchestration.retries times; an update never is (a second attempt
    would take a second optimizer step)."""
    from flows.pipeline import grpo_pipeline
    from forge.stages import LocalStages

    calls = []

    def broken(self, *args):
        calls.append(1)
        raise RuntimeError(f"{stage} exploded")

    monkeypatch.setattr(LocalStages, stage, broken)
    overrides = ["steps=2", "eval.k=0", "orchestration.retries=2", "orchestration.retry_delay_s=0"]
    try:
        grpo_pipeline(preset="tiny", overrides=overrides, name="boom", runs_dir=str(runs_dir))
        raise AssertionError("the flow should have failed")
    except RuntimeError as e:
        assert f"{stage} exploded" in str(e)
    assert len(calls) == tries
    status = json.loads((runs_dir / "boom" / "status.json").read_text())
    assert status["state"] == "failed" and f"{stage} exploded" in status["error"]
    assert not (runs_dir / "boom" / "summary.json").exists()
