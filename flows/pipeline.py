"""The GRPO pipeline as a Prefect flow: one flow run per training run, one task run per stage per step.

The flow is a runbook over `forge.recipes.grpo.GRPORun`: every stage's logic lives there, so the same run
works without Prefect (`forgeweave run --no-prefect`). Stage tasks keep their inputs in memory (no result
persistence, no caching, no input introspection: batches hold tensors) and retry `orchestration.retries` times; a stage that still
fails fails the flow run with its own error. Eval reports are also published as markdown artifacts.

In embedded (ephemeral) mode Prefect records task runs from events that its temporary server processes in
the background; `wait_until_recorded` lets them land before the process exits, so the flow run and all its
task runs are visible through the API afterwards.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from forge.config import RunConfig
from forge.errors import UserError
from forge.recipes.grpo import GRPORun
from forge.records import Rollouts, ScoredBatch, UpdateStats
from forge.rundir import progress_bar, update_bar
from weaver.balance import ThroughputBalancer

STAGE_TASK = {"cache_policy": NONE, "persist_result": False}


@task(name="prepare", **STAGE_TASK)
def prepare_stage(grpo: GRPORun) -> dict:
    grpo.setup()
    return {"train_rows": len(grpo.train_rows), "eval_rows": len(grpo.eval_rows), "start_step": grpo.state.step}


@task(name="rollout", **STAGE_TASK)
def rollout_stage(grpo: GRPORun, step: int) -> tuple[list[dict], Rollouts]:
    return grpo.rollout(step)


@task(name="reward", **STAGE_TASK)
def reward_stage(grpo: GRPORun, rows: list[dict], rollouts: Rollouts) -> ScoredBatch:
    return grpo.reward(rows, rollouts)


@task(name="update", **STAGE_TASK)
def update_stage(grpo: GRPORun, batch: ScoredBatch) -> UpdateStats:
    return grpo.update(batch)


@task(name="evaluate", **STAGE_TASK)
def evaluate_stage(grpo: GRPORun, step: int) -> dict:
    report = grpo.evaluate(step)
    create_markdown_artifact(
        key=artifact_key(grpo.run_dir.name),
        markdown=eval_markdown(grpo.run_dir.name, report),
        description=f"eval at step {step}",
    )
    return report


@task(name="checkpoint", **STAGE_TASK)
def checkpoint_stage(grpo: GRPORun, step: int) -> str:
    return str(grpo.checkpoint(step))


def _stage(fn, name: str, step: int, cfg: RunConfig):
    o = cfg.orchestration
    return fn.with_options(task_run_name=f"{name}-{step:06d}", retries=o.retries, retry_delay_seconds=o.retry_delay_s)


@flow(name="forgeweave-grpo", persist_result=False, log_prints=True)
def grpo_pipeline(
    preset: str = "tiny",
    overrides: list[str] | None = None,
    name: str = "",
    runs_dir: str = "runs",
    config_path: str = "",
    resume: bool = False,
    progress: bool = False,
) -> dict:
    """Train with GRPO: prep → [rollout → reward → update → (evaluate, checkpoint)] × steps.

    preset / config_path / overrides (`section.field=value`) choose the config; name is the run directory under
    runs_dir (default <preset>-<timestamp>); resume continues that run from its latest checkpoint.
    """
    from flows.planning import plan_run
    from flows.runs import resolve_run

    cfg, run_dir = resolve_run(preset, config_path or None, list(overrides or []), name or None, runs_dir, resume)
    from forge.tracking_mlflow import tracker_for_run

    _, plan = plan_run(cfg)
    if cfg.orchestration.execution == "distributed":
        from flows.distributed import run_distributed

        if resume:
            raise UserError("--resume is not supported with orchestration.execution=distributed yet; start a new run")
        return run_distributed(
            cfg,
            run_dir,
            plan,
            progress,
            tracker_tags={"forgeweave.prefect_flow_run_id": str(flow_run.id)},
            prefect_flow_run_id=str(flow_run.id),
            prefect_task_runs=0,
        )
    tracker = tracker_for_run(cfg, run_dir, tags={"forgeweave.prefect_flow_run_id": str(flow_run.id)})
    grpo = GRPORun(cfg, run_dir, resume=resume, plan=plan, tracker=tracker, balancer=ThroughputBalancer)
    tasks = 0
    with grpo.failure_guard():
        _stage(prepare_stage, "prepare", 0, cfg)(grpo)
        bar = progress_bar(cfg.steps, grpo.state.step, progress)
        for step in grpo.remaining_steps():
            rows, rollouts = _stage(rollout_stage, "rollout", step, cfg)(grpo, step)
            # quote(): hand the batch over as is; Prefect would otherwise walk every string and tensor in it
            batch = _stage(reward_stage, "reward", step, cfg)(grpo, quote(rows), quote(rollouts))
            stats = _stage(update_stage, "update", step, cfg)(grpo, quote(batch))
            report = _stage(evaluate_stage, "evaluate", step, cfg)(grpo, step) if grpo.eval_due(step) else None
            metrics = grpo.end_step(step, rows, batch, stats, report)
            if grpo.checkpoint_due(step):
                _stage(checkpoint_stage, "checkpoint", step, cfg)(grpo, step)
            tasks += 3 + (report is not None) + grpo.checkpoint_due(step)
            update_bar(bar, metrics, grpo.state.last_eval)
        if bar is not None:
            bar.close()
        return grpo.finish(prefect_flow_run_id=str(flow_run.id), prefect_task_runs=tasks + 1)


@flow(name="forgeweave-evaluate", persist_result=False, log_prints=True)
def evaluate_checkpoint(checkpoint: str, preset: str = "", overrides: list[str] | None = None) -> dict:
    """Evaluate a checkpoint directory on its run's eval split (or a preset's); the report lands beside it."""
    from flows.evaluation import evaluate_checkpoint_dir

    report = evaluate_checkpoint_dir(Path(checkpoint), preset or None, list(overrides or []))
    create_markdown_artifact(key=artifact_key(Path(checkpoint).name), markdown=eval_markdown(checkpoint, report))
    return {k: v for k, v in report.items() if k != "samples"}


@flow(name="forgeweave-prepare-dataset", persist_result=False, log_prints=True)
def prepare_dataset(
    out_dir: str, preset: str = "tiny", config_path: str = "", overrides: list[str] | None = None
) -> dict:
    """The prep stage alone: validate a dataset (or generate the built-in task) into out_dir/data/."""
    from flows.runs import resolve_config
    from forge.data import prepare
    from forge.models import format_prompt_fn, load_policy

    cfg = resolve_config(preset or None, config_path or None, list(overrides or []))
    _, tok = load_policy(cfg.model, seed=cfg.seed)
    data = prepare(
        cfg, Path(out_dir), format_prompt_fn(tok, cfg.model), lambda s: len(tok(s, add_special_tokens=False).input_ids)
    )
    return data.manifest


def artifact_key(run_name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "eval-" + (re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-") or "run")


def eval_markdown(run_name: str, report: dict) -> str:
    rows = [(k, f"{v:.4f}") for k, v in report.items() if k.startswith("pass@") or k == "mean_reward"]
    lines = [f"### {run_name}: eval at step {report.get('step')}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", f"{report.get('problems')} problems, {report.get('seconds', 0):.1f} s"]
    return "\n".join(lines)


def wait_until_recorded(flow_run_id: str, expected: int, timeout: float = 120.0) -> int:
    """Block until the API lists `expected` finished task runs for the flow run (or timeout); returns the count."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30)
    deadline = time.monotonic() + timeout
    count = 0
    while time.monotonic() < deadline:
        count = asyncio.run(count_finished_task_runs(flow_run_id))
        if count >= expected:
            break
        time.sleep(0.5)
    return count


async def count_finished_task_runs(flow_run_id: str) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        total, offset = 0, 0
        while True:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200, offset=offset
            )
            total += sum(1 for r in runs if r.state is not None and r.state.is_final())
            if len(runs) < 200:
                return total
            offset += 200
