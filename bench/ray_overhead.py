"""Ray execution vs in-process: seconds per GRPO step on the tiny preset and on a `smollm2-arith` step.

Both paths run the same config in one invocation, alternating (in-process, Ray, in-process, Ray, ...), so machine
noise hits both. Ray mode starts a private local Ray instance per run (one node offering every pool): the trainer,
the rollout and the reward each live in their own actor, and the new weights go from the trainer to the rollout
actor through Ray's object store every step (`perf/weight_sync_s`). A step's seconds are its rollout + reward +
update time from metrics.jsonl (the update includes moving the weights), the first step (warm-up) left out;
start-up is the run's wall time minus its steps. Evaluation and checkpoints are off so only the step is timed.
Usage: python bench/ray_overhead.py [--tiny-steps 40] [--smollm-steps 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
QUIET = ["eval.every=0", "eval.k=0", "eval.max_problems=4", "checkpoint.every=0", "tracking.mlflow=false"]


def one_run(preset: str, steps: int, execution: str, run_dir: Path) -> dict:
    from flows.execute import train
    from flows.planning import plan_run
    from flows.runs import resolve_run
    from forge.tracking import read_metrics

    cfg, run_dir = resolve_run(preset, None, [f"steps={steps}", f"orchestration.execution={execution}", *QUIET],
                               run_dir.name, str(run_dir.parent), False)  # fmt: skip
    _, plan = plan_run(cfg)
    t0 = time.perf_counter()
    train(cfg, run_dir, plan, progress=False)
    wall = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps_s = [sum(r[f"time/{s}_s"] for s in ("rollout", "reward", "update")) for r in rows if r["step"] > 0]
    sync = [r["perf/weight_sync_s"] for r in rows if r["step"] > 1]
    return {
        "step_s": statistics.median(steps_s[1:]),
        "startup_s": wall - sum(steps_s),
        "sync_s": statistics.median(sync),
    }


def compare(preset: str, steps: int, repeats: int, root: Path) -> None:
    results: dict[str, list[dict]] = {"embedded": [], "ray": []}
    for i in range(repeats):
        for execution in results:
            results[execution].append(one_run(preset, steps, execution, root / f"{preset}-{execution}-{i}"))
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in results.items()}
    a, b = med["embedded"], med["ray"]
    print(f"\n{preset}: {steps} steps per run, median of {repeats} runs per path")
    print(f"{'path':<14}{'s/step':>10}{'start-up s':>12}{'weight sync s':>15}")
    for name, m in (("in-process", a), ("ray", b)):
        print(f"{name:<14}{m['step_s']:>10.3f}{m['startup_s']:>12.1f}{m['sync_s']:>15.3f}")
    print(f"ray / in-process seconds per step: {b['step_s'] / a['step_s']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny-steps", type=int, default=40)
    ap.add_argument("--smollm-steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["tiny", "smollm2-arith"], help="run one preset only")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fw-bench-ray-"))
    print(f"machine: {os.cpu_count()} cores; runs in {root}")
    if args.only in (None, "tiny"):
        compare("tiny", args.tiny_steps, args.repeats, root)
    if args.only in (None, "smollm2-arith"):
        compare("smollm2-arith", args.smollm_steps, args.repeats, root)


if __name__ == "__main__":
    main()
