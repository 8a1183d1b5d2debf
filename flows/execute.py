"""Run a training job where its config says: in this process, or on Ray actors placed by Weaver's plan.

The one place that picks the `Stages` for the loop (`forge.recipes.grpo.run`); the CLI's plain mode and the
Prefect flow both come through here, so both run in Ray mode the same way. Ray is imported only when used.
"""

from __future__ import annotations

import os
from pathlib import Path

from forge.config import RunConfig
from forge.errors import UserError
from forge.stages import StageRunner, call_stage
from forge.tracking import Tracker


def use_ray(cfg: RunConfig, plan: dict | None) -> bool:
    """Whether a run's stages go to Ray actors (see orchestration.execution)."""
    o = cfg.orchestration
    if o.execution != "auto":
        return o.execution == "ray"
    return _needs_processes(cfg, plan) or bool(o.ray_address)


def _needs_processes(cfg: RunConfig, plan: dict | None) -> bool:
    r = cfg.rollout
    # asynchronous GRPO samples from older weights while the trainer steps: a rollout process of its own
    return r.backend == "vllm" or r.replicas > 1 or update_processes(cfg, plan) > 1 or cfg.algo.max_staleness > 0


def update_processes(cfg: RunConfig, plan: dict | None) -> int:
    """update.num_processes if set, else what the plan gives the update stage, else 1."""
    if cfg.update.num_processes > 0:
        return cfg.update.num_processes
    for a in (plan or {}).get("assignments", []):
        if a.get("stage") == "update":
            return sum(p["processes"] for p in a["placements"])
    return 1


def train(
    cfg: RunConfig,
    run_dir: Path,
    plan: dict,
    *,
    resume: bool = False,
    tracker: Tracker | None = None,
    progress: bool = True,
    runner: StageRunner = call_stage,
    **summary_extra,
) -> dict:
    """Train (forge.recipes.grpo.run) with in-process stages or Ray stages; returns summary.json's content."""
    from forge.recipes.grpo import run

    kwargs = dict(resume=resume, tracker=tracker, progress=progress, plan=plan, runner=runner)
    if use_ray(cfg, plan):
        if not cfg.orchestration.ray_address:  # a private instance: one machine, 127.0.0.1 only (read at import)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        from flows.ray_exec import RayStages, ray_session

        with ray_session(cfg, plan, run_dir.name):
            return run(cfg, run_dir, stages=RayStages, **kwargs, execution="ray", **summary_extra)
    if _needs_processes(cfg, plan):
        raise UserError(
            "orchestration.execution=embedded runs one process, but rollout.backend=vllm, rollout.replicas>1, "
            "update.num_processes>1 and algo.max_staleness>0 need several: set orchestration.execution=ray (or auto)"
        )
    return run(cfg, run_dir, **kwargs, execution="embedded", **summary_extra)
