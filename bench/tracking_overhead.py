"""MLflow tracking overhead: the tiny preset with metrics.jsonl only vs metrics.jsonl + MLflow (embedded sqlite).

Both run in this process through the plain recipe, alternating, so machine noise hits both. The MLflow run logs
what `forgeweave run` logs: params, tags, every step's metrics, a samples table per step, eval reports and
checkpoints (logged + registered). Prints seconds per step for each, the overhead per step, and how long the end
of the run waited for the sender to drain the outbox. A warm-up run creates the MLflow database first (a one-off
cost, printed too).
Usage: python bench/tracking_overhead.py [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def one_run(runs: Path, name: str, overrides: list[str], mlflow: bool) -> tuple[float, float]:
    """(wall seconds of the whole run, seconds spent in tracker.finish waiting for the outbox to drain)."""
    from flows.runs import resolve_run
    from flows.tracking.mlflow_tracker import tracker_for_run
    from forge.recipes.grpo import run

    cfg, run_dir = resolve_run("tiny", None, [*overrides, f"tracking.mlflow={mlflow}"], name, str(runs), False)
    tracker = tracker_for_run(cfg, run_dir)
    waited = [0.0]
    if tracker is not None:
        finish = tracker.finish

        def timed_finish(status: str) -> None:
            t = time.perf_counter()
            finish(status)
            waited[0] = time.perf_counter() - t

        tracker.finish = timed_finish
    t = time.perf_counter()
    run(cfg, run_dir, progress=False, tracker=tracker)
    return time.perf_counter() - t, waited[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    overrides = [f"steps={args.steps}", "eval.every=20", "eval.k=0", "checkpoint.every=20", "threads=1"]
    runs = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    t = time.perf_counter()
    one_run(runs, "warmup", ["steps=1", "eval.k=0", "threads=1"], mlflow=True)
    warmup = time.perf_counter() - t
    plain, tracked, waits = [], [], []
    for i in range(args.repeats):
        plain.append(one_run(runs, f"jsonl-{i}", overrides, mlflow=False)[0])
        wall, waited = one_run(runs, f"mlflow-{i}", overrides, mlflow=True)
        tracked.append(wall)
        waits.append(waited)
    p, m = statistics.median(plain) / args.steps, statistics.median(tracked) / args.steps
    print(f"tiny preset, {args.steps} steps, {args.repeats} repeats each (median), runs in {runs}")
    print(f"metrics.jsonl only     : {p:.3f} s/step")
    print(f"+ MLflow (sqlite)      : {m:.3f} s/step   ratio {m / p:.3f}  (+{(m - p) * 1000:.1f} ms/step)")
    print(f"end-of-run drain wait  : {statistics.median(waits):.2f} s (median)")
    print(f"warm-up incl. creating mlflow.db: {warmup:.1f} s")


if __name__ == "__main__":
    main()
