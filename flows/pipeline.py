"""The GRPO pipeline as a Prefect flow: one flow run per training run, one task run per stage per step.

The flow is an adapter, not a loop: it hands `forge.recipes.grpo.run` (through `flows.execute.train`, which picks
in-process or Ray stages) a stage runner that makes every stage call a task run, so the same run works without
Prefect (`forgeweave run --no-prefect`). Stage tasks keep their inputs in memory (no result persistence, no
caching, no input introspection: batches hold tensors) and retry `orchestration.retries` times where a stage is
safe to repeat; a stage that still fails fails the flow run with its own error. Eval reports are also published
as markdown artifacts.

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
from forge.io import write_json
from forge.stages import Stage

STAGE_TASK = {"cache_policy": NONE, "persist_result": False}


@task(name="stage", **STAGE_TASK)
def stage_task(fn, *args):
    return fn(*args)


class PrefectRunner:
    """The loop's stage runner as Prefect task runs: one per stage per step, named `<stage>-<step>`, retried
    `orchestration.retries` times where that is safe (`forge.stages.Stage.retry_safe`); each eval report is also a markdown artifact.

    Task runs carry no tags: in Prefect 3.9 a tagged task run looks up tag concurrency limits through the API,
    which was measured here to triple the tiny preset's step time (30 steps: 59 s with pool/stage tags, 19 s
    without)."""

    def __init__(self, cfg: RunConfig, run_name: str):
        self.cfg, self.run_name, self.task_runs = cfg, run_name, 0

    def __call__(self, stage: Stage, step: int, fn, *args):
        o = self.cfg.orchestration
        retries = o.retries if stage.retry_safe else 0
        t = stage_task.with_options(
            name=stage.value,
            task_run_name=f"{stage.value}-{step:06d}",
            retries=retries,
            retry_delay_seconds=o.retry_delay_s,
        )
        # quote(): hand the batch over as is; Prefect would otherwise walk every string and tensor in it
        result = t(quote(fn), *[quote(a) for a in args])
        self.task_runs += 1
        if stage is Stage.EVALUATE:
            create_markdown_artifact(
                key=artifact_key(self.run_name), markdown=eval_markdown(self.run_name, result),
                description=f"eval at step {step}",
            )  # fmt: skip
        return result


@flow(name="forgeweave-grpo", persist_result=False, log_prints=True)
def grpo_pipeline(
    preset: str = "",
    overrides: list[str] | None = None,
    name: str = "",
    runs_dir: str = "runs",
    config_path: str = "",
    resume: bool = False,
    progress: bool = False,
) -> dict:
    """Train with GRPO: prep → [rollout → reward → update → (evaluate, checkpoint)] × steps.

    preset (the base; empty = config_path's `preset:` key, else tiny), config_path (a YAML file overlaying the keys
    it sets) and overrides (`section.field=value`, applied last) choose the config; name is the run directory under
    runs_dir (default <preset>-<timestamp>); resume continues that run from its latest checkpoint. With
    orchestration.execution=ray (or auto, when the run needs it) the stages run on Ray actors.
    """
    from flows.deployments import confined
    from flows.execute import train
    from flows.planning import plan_run
    from flows.runs import resolve_run
    from flows.tracking import trackers_for_run

    runs_dir, config_path = confined(runs_dir, "runs_dir"), confined(config_path, "config_path")
    cfg, run_dir = resolve_run(preset, config_path or None, list(overrides or []), name or None, runs_dir, resume)
    _, plan = plan_run(cfg)
    tracker = trackers_for_run(cfg, run_dir, tags={"forgeweave.prefect_flow_run_id": str(flow_run.id)})
    runner = PrefectRunner(cfg, run_dir.name)
    summary = train(cfg, run_dir, plan, resume=resume, tracker=tracker, progress=progress, runner=runner,
                    prefect_flow_run_id=str(flow_run.id))  # fmt: skip
    summary["prefect_task_runs"] = runner.task_runs  # known only once the loop is done
    write_json(run_dir / "summary.json", summary)
    return summary


@flow(name="forgeweave-evaluate", persist_result=False, log_prints=True)
def evaluate_checkpoint(checkpoint: str, preset: str = "", overrides: list[str] | None = None) -> dict:
    """Evaluate a checkpoint directory on its run's eval split (or a preset's); the report lands beside it."""
    from flows.deployments import confined
    from flows.evaluation import evaluate_checkpoint_dir

    checkpoint = confined(checkpoint, "checkpoint")
    report = evaluate_checkpoint_dir(Path(checkpoint), preset or None, list(overrides or []))
    create_markdown_artifact(key=artifact_key(Path(checkpoint).name), markdown=eval_markdown(checkpoint, report))
    return {k: v for k, v in report.items() if k != "samples"}


@flow(name="forgeweave-prepare-dataset", persist_result=False, log_prints=True)
def prepare_dataset(out_dir: str, preset: str = "", config_path: str = "", overrides: list[str] | None = None) -> dict:
    """The prep stage alone: validate a dataset (or generate the built-in task) into out_dir/data/."""
    from flows.deployments import confined
    from flows.runs import resolve_config
    from forge.compose import data_sources
    from forge.data import prepare
    from forge.models import format_prompt_fn, load_policy

    out_dir, config_path = confined(out_dir, "out_dir"), confined(config_path, "config_path")
    cfg = resolve_config(preset or None, config_path or None, list(overrides or []))
    _, tok = load_policy(cfg.model, seed=cfg.seed)
    data = prepare(
        data_sources(cfg),
        Path(out_dir),
        format_prompt_fn(tok, cfg.model),
        lambda s: len(tok(s, add_special_tokens=False).input_ids),
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
