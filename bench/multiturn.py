"""Multi-turn learning on this CPU: the `smollm2-multiturn` preset (SmolLM2-135M-Instruct, 2-digit sums, a wrong
reply gets a hint and another try, up to 3 turns), held-out first-turn and final-turn success before and after.

Per seed, one run in this process (`forge.recipes.grpo.run`, plain mode, no checkpoints): the greedy eval on the
preset's held-out sums at step 0 and after the last step gives `first_turn@1` (the first reply alone is right) and
`final_turn@1` (the episode's last reply is right: the run's objective). An episode ends at its first right reply,
so final >= first on every row; their difference is the share of rows solved only thanks to the feedback. Noise: the
binomial standard error of a share over the held-out rows, sqrt(p (1 - p) / n), and for the final - first gap the
same over its rows (a paired difference: each row adds 0 or 1 to it), plus the spread across seeds when several
are run. Results go to `--out`/results.jsonl; a seed already recorded there (same steps and rows) is reused.

Usage: python bench/multiturn.py [--seeds 0,1] [--steps 20] [--eval-rows 40] [--out /tmp/multiturn-bench]
       [--preset smollm2-multiturn] [--set key=value ...]  (e.g. --preset tiny-multiturn --steps 2: a smoke run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's forge, not an installed one
SPLIT = ("first_turn@1", "final_turn@1", "mean_turns")


def run_seed(preset: str, seed: int, steps: int, rows: int, sets: list[str], progress: bool) -> dict:
    """One training run; the eval split's first/final-turn success at step 0 and at the end, and seconds per step."""
    from forge.config import apply_overrides
    from forge.presets import get_preset
    from forge.recipes.grpo import run
    from forge.tracking import read_metrics

    cfg = apply_overrides(get_preset(preset), [f"seed={seed}", f"steps={steps}", f"eval.every={steps}",
                                               f"eval.max_problems={rows}", "eval.k=0", "checkpoint.every=0",
                                               "tracking.mlflow=false", *sets])  # fmt: skip
    run_dir = Path(tempfile.mkdtemp(prefix=f"multiturn-{seed}-"))
    t0 = time.perf_counter()
    summary = run(cfg, run_dir, progress=progress)
    wall = time.perf_counter() - t0
    before, after = summary["eval"]["initial"], summary["eval"]["final"]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    step_s = [m["perf/step_s"] for m in metrics if "perf/step_s" in m]
    return {"seed": seed, "steps": steps, "rows": after["problems"], "preset": preset, "sets": sets,
            "before": {k: before[k] for k in SPLIT}, "after": {k: after[k] for k in SPLIT},
            "s_per_step": sorted(step_s)[len(step_s) // 2] if step_s else None, "wall_s": round(wall),
            "reward_first5": _mean([m["reward/mean"] for m in metrics if "reward/mean" in m][:5]),
            "reward_last5": _mean([m["reward/mean"] for m in metrics if "reward/mean" in m][-5:])}  # fmt: skip


def stderr(p: float, n: int) -> float:
    """Binomial standard error of a share p over n rows.

    >>> round(stderr(0.5, 40), 3)
    0.079
    """
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def report(r: dict) -> str:
    """One seed's table rows: final-turn before -> after, and the first/final split after training, with their SEs."""
    n, b, a = r["rows"], r["before"], r["after"]
    gap = a["final_turn@1"] - a["first_turn@1"]
    return "\n".join([
        f"seed {r['seed']}: {r['steps']} steps, {n} held-out rows, {r['s_per_step']:.1f} s/step (median), "
        f"{r['wall_s']} s wall; train reward (first / last 5 steps) {r['reward_first5']:.3f} / "
        f"{r['reward_last5']:.3f}",
        f"  final turn  {b['final_turn@1']:.3f} -> {a['final_turn@1']:.3f}  "
        f"({a['final_turn@1'] - b['final_turn@1']:+.3f}; SE of each {stderr(b['final_turn@1'], n):.3f} / "
        f"{stderr(a['final_turn@1'], n):.3f})",
        f"  first turn  {b['first_turn@1']:.3f} -> {a['first_turn@1']:.3f}",
        f"  after: final - first = {gap:+.3f} (SE {stderr(gap, n):.3f}); mean turns {b['mean_turns']:.2f} -> "
        f"{a['mean_turns']:.2f}",
    ])  # fmt: skip


def summary(results: list[dict]) -> str:
    """Across seeds: mean and spread (min-max) of the final-turn rise and of the after-training gap."""
    rise = [r["after"]["final_turn@1"] - r["before"]["final_turn@1"] for r in results]
    gap = [r["after"]["final_turn@1"] - r["after"]["first_turn@1"] for r in results]
    return (f"seeds {[r['seed'] for r in results]}: final-turn rise mean {_mean(rise):+.3f} (min {min(rise):+.3f}, "
            f"max {max(rise):+.3f}); final - first after mean {_mean(gap):+.3f} (min {min(gap):+.3f}, "
            f"max {max(gap):+.3f})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-rows", type=int, default=40)
    ap.add_argument("--preset", default="smollm2-multiturn")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="an override key=value (repeatable)")
    ap.add_argument("--out", default="/tmp/multiturn-bench")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    old = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    key = (args.preset, args.steps, args.eval_rows, args.sets)
    done = {r["seed"]: r for r in old if (r["preset"], r["steps"], r["rows_asked"], r["sets"]) == key}
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; preset {args.preset}, {args.steps} steps, "
          f"{args.eval_rows} held-out rows, overrides {args.sets}", flush=True)  # fmt: skip
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        if seed not in done:
            r = run_seed(args.preset, seed, args.steps, args.eval_rows, args.sets, not args.quiet)
            done[seed] = {**r, "rows_asked": args.eval_rows}
            with path.open("a") as f:
                f.write(json.dumps(done[seed]) + "\n")
        results.append(done[seed])
        print(report(done[seed]), flush=True)
    print(summary(results))
    print(f"peak RSS {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
