"""Distributed execution (`orchestration.execution: distributed`): every stage is its own Prefect deployment.

The driver (the pipeline flow, wherever `forgeweave run` runs) registers one deployment of the `forgeweave-stage`
flow per stage on the Prefect work pool Weaver's plan gives that stage's pool, then runs the steps by triggering
those deployments one after another (`run_deployment`, each a subflow run of the pipeline in the UI). A worker of
that work pool — on this machine or another one that sees the same run directory — picks the stage up and runs it
in a fresh process: it attaches to the run directory (`GRPORun.build` + `forge.recipes.live.load_live`), runs the
stage, and leaves its output and the changed state in the run directory (`forge.recipes.live`). Weights, batches and
reports travel only through the run directory, so on a cluster it must be shared storage.

The driver does the bookkeeping the in-process loop does between stages (`GRPORun.end_step`: metrics, samples,
status; `summary.json` at the end) and never loads the model. With the same config, a distributed run computes
the same numbers as the in-process loop: every stage restores the RNG state the previous one saved.

Stage → plan stage (whose pool runs it): prepare → prep, rollout → rollout, reward → reward, update → update,
evaluate → evaluate (it runs in rollout's pool), checkpoint → update (the process family that owns the trainer).
Each deployment carries Weaver's environment for its stage (`weaver.apply.stage_env`: threads, devices).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefect import flow

from forge.checkpoint import step_dir_name
from forge.config import RunConfig, dump_yaml, load_yaml
from forge.errors import UserError
from forge.io import atomic_write_text, write_json
from forge.recipes.grpo import GRPORun, eval_metrics
from forge.recipes.live import (
    load_live,
    load_stage_output,
    read_run_state,
    save_live,
    save_stage_output,
    write_run_state,
)
from forge.rundir import claim_run_dir, progress_bar, track_run_start, update_bar

STAGE_FLOW = "forgeweave-stage"
PLAN_STAGE = {
    "prepare": "prep",
    "rollout": "rollout",
    "reward": "reward",
    "update": "update",
    "evaluate": "evaluate",
    "checkpoint": "update",
}
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the stage side (runs on a worker)


@flow(name=STAGE_FLOW, persist_result=False, log_prints=True)
def stage_flow(run_dir: str, stage: str, step: int = 0) -> str:
    """Run one stage of one step against a run directory; returns the path of the stage's output file."""
    return str(run_stage(Path(run_dir), stage, step))


def run_stage(run_dir: Path, stage: str, step: int) -> Path:
    if stage not in PLAN_STAGE:
        raise UserError(f"unknown stage {stage!r} (stages: {', '.join(PLAN_STAGE)})")
    cfg = load_yaml(run_dir / "config.yaml")
    t0 = time.perf_counter()
    if stage == "prepare":
        grpo = GRPORun(cfg, run_dir, attach=True)  # the driver created the directory; prep data, initial eval
        grpo.setup()
        save_live(grpo)
        write_run_state(run_dir, grpo.state)
        return save_stage_output(run_dir, step, stage, {"seconds": time.perf_counter() - t0})
    grpo = GRPORun(cfg, run_dir, resume=True)
    grpo.build()
    load_live(grpo)
    output = _STAGES[stage](grpo, run_dir, step)
    return save_stage_output(run_dir, step, stage, {**output, "seconds": time.perf_counter() - t0})


def _rollout(grpo: GRPORun, run_dir: Path, step: int) -> dict:
    rows, rollouts = grpo.rollout(step)
    save_live(grpo, policy=False)  # the sampler cursor and the RNG moved; weights did not
    return {"rows": rows, "rollouts": rollouts}


def _reward(grpo: GRPORun, run_dir: Path, step: int) -> dict:
    prev = load_stage_output(run_dir, step, "rollout")
    batch = grpo.reward(prev["rows"], prev["rollouts"])
    save_live(grpo, policy=False)  # the ensemble's window grew; weights did not
    return {"batch": batch, "ensemble_report": grpo.ensemble_report}


def _update(grpo: GRPORun, run_dir: Path, step: int) -> dict:
    stats = grpo.update(load_stage_output(run_dir, step, "reward")["batch"])
    save_live(grpo)  # new weights, optimizer state, policy version
    return {"stats": stats}


def _evaluate(grpo: GRPORun, run_dir: Path, step: int) -> dict:
    return {"report": grpo.evaluate(step)}  # pass@k sampling uses its own RNG: nothing to save


def _checkpoint(grpo: GRPORun, run_dir: Path, step: int) -> dict:
    return {"path": str(grpo.checkpoint(step))}


_STAGES = {"rollout": _rollout, "reward": _reward, "update": _update, "evaluate": _evaluate, "checkpoint": _checkpoint}


# ---------------------------------------------------------------- the driver side


def run_distributed(
    cfg: RunConfig, run_dir: Path, plan: dict, progress: bool = False, tracker_tags: dict | None = None, **extra
) -> dict:
    """The GRPO loop with every stage on its pool's Prefect work pool; returns summary.json's content."""
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError(
            "orchestration.execution=distributed needs a Prefect server and workers: start one (`forgeweave server`), "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api and start a worker per work pool (see README)"
        )
    if cfg.rollout.backend != "hf" or cfg.update.num_processes > 1:
        raise UserError(
            "orchestration.execution=distributed runs each stage in a fresh process: use rollout.backend=hf and "
            "update.num_processes=1 with it (engines and update ranks that outlive a stage are not supported yet)"
        )
    deployments = stage_deployments(plan)  # fails before anything is written when a pool has no work pool
    claim_run_dir(run_dir, resume=False)
    register_deployments(deployments, plan)
    from forge.tracking_mlflow import tracker_for_run

    tracker = tracker_for_run(cfg, run_dir, tags=tracker_tags)
    timeout = cfg.orchestration.stage_timeout_s
    call = lambda stage, step: trigger(deployments, run_dir, stage, step, timeout)  # noqa: E731
    return drive(cfg, run_dir, plan, call, progress, tracker=tracker, **extra)


def drive(cfg: RunConfig, run_dir: Path, plan: dict, call_stage, progress: bool = False, tracker=None, **extra) -> dict:
    """The driver's loop over a claimed, empty run directory; `call_stage(stage, step)` runs a stage somewhere and
    returns when its output is in the run directory. The driver's `tracker` (MLflow) gets what the stages wrote."""
    atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
    write_json(run_dir / "plan.json", plan)
    call_stage("prepare", 0)
    grpo = GRPORun(cfg, run_dir, resume=True, tracker=tracker)  # bookkeeping only: the driver never builds the model
    grpo.state = read_run_state(run_dir)
    if tracker is not None:  # the prepare stage logged the initial eval to metrics.jsonl only
        track_run_start(tracker, cfg, run_dir)
        tracker.log_metrics(eval_metrics(grpo.state.initial_eval), step=0)
    with grpo.failure_guard():
        bar = progress_bar(cfg.steps, grpo.state.step, progress)
        for step in grpo.remaining_steps():
            for stage in ("rollout", "reward", "update"):
                call_stage(stage, step)
            report = None
            if grpo.eval_due(step):
                call_stage("evaluate", step)
                report = grpo.state.last_eval = load_stage_output(run_dir, step, "evaluate")["report"]
                grpo.tracker.log_artifact(run_dir / "eval" / f"{step_dir_name(step)}.json", "eval")
            metrics = _end_step(grpo, run_dir, step, report)
            if grpo.checkpoint_due(step):
                call_stage("checkpoint", step)
                path = Path(load_stage_output(run_dir, step, "checkpoint")["path"])
                score = report["pass@1"] if report is not None else None
                grpo.tracker.register_checkpoint(path, step, score)
            update_bar(bar, metrics, grpo.state.last_eval)
        if bar is not None:
            bar.close()
        return grpo.finish(execution="distributed", **extra)


def _end_step(grpo: GRPORun, run_dir: Path, step: int, report: dict | None) -> dict[str, float]:
    out = {s: load_stage_output(run_dir, step, s) for s in ("rollout", "reward", "update")}
    grpo.times = {s: o["seconds"] for s, o in out.items()}
    if report is not None:
        grpo.times["evaluate"] = report["seconds"]
    grpo.ensemble_report = out["reward"]["ensemble_report"]
    metrics = grpo.end_step(step, out["rollout"]["rows"], out["reward"]["batch"], out["update"]["stats"], report)
    write_run_state(run_dir, grpo.state)
    return metrics


def stage_deployments(plan: dict) -> dict[str, tuple[str, str]]:
    """stage -> (deployment name under the stage flow, work pool), from the plan's assignments."""
    by_stage = {a["stage"]: a["placements"][0] for a in plan["assignments"]}
    out = {}
    for stage, planned in PLAN_STAGE.items():
        placement = by_stage[planned]
        if not placement["work_pool"]:
            raise UserError(
                f"orchestration.execution=distributed: pool '{placement['pool']}' (stage {planned}) has no work_pool; "
                "declare pools with `work_pool: NAME` in the config's pools or --pools file"
            )
        out[stage] = (f"{stage}-{placement['work_pool']}", placement["work_pool"])
    return out


def register_deployments(deployments: dict[str, tuple[str, str]], plan: dict) -> None:
    """Create/update one deployment per stage on its work pool, with Weaver's environment for the stage."""
    from weaver.apply import prefect_tags, stage_env
    from weaver.plan import Plan

    p = Plan.from_dict(plan)
    cores = {pool["name"]: pool.get("cpu_cores", 1) for pool in plan.get("pools", [])}
    source = stage_flow.from_source(source=str(REPO_ROOT), entrypoint="flows/distributed.py:stage_flow")
    for stage, (name, work_pool) in deployments.items():
        planned = PLAN_STAGE[stage]
        env = stage_env(p, planned, cores.get(p.for_stage(planned).pool, 1))
        source.deploy(
            name=name,
            work_pool_name=work_pool,
            job_variables={"env": env},
            tags=["forgeweave", *prefect_tags(p, planned)],
            build=False,
            push=False,
            print_next_steps=False,
        )


def trigger(deployments: dict[str, tuple[str, str]], run_dir: Path, stage: str, step: int, timeout: float) -> None:
    """Run one stage's deployment and wait for it; a failed or timed-out stage raises with its state message."""
    from prefect.deployments import run_deployment

    name, work_pool = deployments[stage]
    fr = run_deployment(
        name=f"{STAGE_FLOW}/{name}",
        parameters={"run_dir": str(run_dir.resolve()), "stage": stage, "step": step},
        flow_run_name=f"{stage}-{step:06d}",
        timeout=timeout,
        poll_interval=1,
    )
    state = fr.state
    if state is None or not state.is_completed():
        what = f"{state.name}: {state.message}" if state is not None else "no state"
        raise RuntimeError(
            f"stage {stage} of step {step} on work pool '{work_pool}' did not complete ({what}); "
            f"is a worker running (`prefect worker start --pool {work_pool}`)?"
        )
