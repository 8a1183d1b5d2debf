"""Orchestration overhead: the tiny preset as a Prefect flow (embedded server) vs the plain recipe (--no-prefect).

Both run in this process, alternating, so machine noise hits both. Prints per-step wall time for each path, the
overhead per step (the goal is <= 3% of step time), the one-off flow start-up, and the time the embedded server
then needs to record all task runs (paid once, at exit).
Usage: python bench/orchestration_overhead.py [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def plain(runs: Path, name: str, overrides: list[str]) -> tuple[float, float]:
    from flows.runs import resolve_run
    from forge.recipes.grpo import run

    cfg, run_dir = resolve_run("tiny", None, overrides, name, str(runs), False)
    t = time.perf_counter()
    summary = run(cfg, run_dir, progress=False)
    return time.perf_counter() - t, _loop_seconds(summary)


def with_prefect(runs: Path, name: str, overrides: list[str]) -> tuple[float, float, float]:
    from flows.pipeline import grpo_pipeline, wait_until_recorded

    t = time.perf_counter()
    summary = grpo_pipeline(preset="tiny", overrides=overrides, name=name, runs_dir=str(runs))
    wall = time.perf_counter() - t
    t = time.perf_counter()
    wait_until_recorded(summary["prefect_flow_run_id"], summary["prefect_task_runs"])
    return wall, _loop_seconds(summary), time.perf_counter() - t


def _loop_seconds(summary: dict) -> float:
    """Wall seconds of the step loop as the run measured it (total minus setup is not separable; use total)."""
    return summary["seconds"]["total"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    overrides = [f"steps={args.steps}", "eval.every=0", "eval.k=0", "checkpoint.every=0", "threads=1"]
    runs = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    with_prefect(runs, "warmup", ["steps=2", "eval.k=0", "threads=1"])  # starts the embedded server once
    p_run, f_run, f_wall, f_record = [], [], [], []
    for i in range(args.repeats):
        _, run_s = plain(runs, f"plain-{i}", overrides)
        p_run.append(run_s)
        wall, run_s, record = with_prefect(runs, f"flow-{i}", overrides)
        f_run.append(run_s)
        f_wall.append(wall)
        f_record.append(record)
    p, f = statistics.median(p_run), statistics.median(f_run)
    tasks = 1 + 3 * args.steps + 2
    print(f"tiny preset, {args.steps} steps, {tasks} task runs per flow run, median of {args.repeats}")
    print(f"{'path':<22}{'run s':>10}{'per step s':>12}")
    print(f"{'plain recipe':<22}{p:>10.2f}{p / args.steps:>12.4f}")
    print(f"{'prefect flow':<22}{f:>10.2f}{f / args.steps:>12.4f}")
    print(
        f"overhead per step: {(f - p) / args.steps * 1000:.1f} ms = {(f - p) / p:.1%} of step time "
        f"({(f - p) / tasks * 1000:.1f} ms per task run)"
    )
    print(
        f"flow start-up + teardown: {statistics.median(f_wall) - f:.2f} s; "
        f"waiting for the embedded server to record all task runs: {statistics.median(f_record):.2f} s"
    )


if __name__ == "__main__":
    main()
