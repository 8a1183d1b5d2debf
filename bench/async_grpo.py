"""Asynchronous vs on-policy GRPO: seconds per step and learning, measured in one invocation.

The task of the speed issue: SmolLM2-135M-Instruct on 2-digit `+`/`-` problems ("Compute 37 + 48. Reply with only
the final integer, nothing else."), 4 prompts x 8 samples, <= 32 new tokens, T = 0.7, lr 1e-5, DAPO loss, linear
decay, no KL. Rollout is a vLLM engine (a Ray actor run by `.venv-vllm`'s python) on pool `gen`, the update a
trainer actor on pool `train`, each pool one core of this machine (the engine is pinned to its core). The same
config runs twice, on-policy (`algo.max_staleness=0`) and one step off (`max_staleness=1`, TIS correction), with
greedy pass@1 on 200 held-out problems before and after.

Seconds per step are `perf/step_s` (the loop's wall time of a step: waiting for the rollout, reward, update),
median over the steps after the first two (warm-up, and the start of the one-step-off pipeline). "ideal" is
max(rollout, update) / (rollout + update) from the on-policy run's own stage times: what a perfect overlap gives.
Usage: python bench/async_grpo.py [--steps 32] [--eval-problems 200] [--set rollout.max_new_tokens=96 ...]
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

from arith_task import PRESET  # noqa: E402
from arith_task import TASK as ARITH_TASK  # noqa: E402

TASK = [*ARITH_TASK, "rollout.backend=vllm"]
POOLS = [
    {"name": "gen", "kind": "cpu", "cpu_cores": 1, "stages": ["prep", "rollout", "reward", "evaluate"]},
    {"name": "train", "kind": "cpu", "cpu_cores": 1, "stages": ["update"]},
]


def one_run(staleness: int, steps: int, problems: int, run_dir: Path, extra: list[str]) -> dict:
    from flows.execute import train
    from flows.planning import plan_run
    from flows.runs import resolve_run
    from forge.tracking import read_metrics

    sets = [*TASK, *extra, f"steps={steps}", f"eval.max_problems={problems}", f"algo.max_staleness={staleness}"]
    cfg, run_dir = resolve_run(PRESET, None, sets, run_dir.name, str(run_dir.parent), False)
    cfg.pools = POOLS
    _, plan = plan_run(cfg)
    t0 = time.perf_counter()
    summary = train(cfg, run_dir, plan, progress=False)
    wall = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    rows = [r for r in rows if r["step"] > 2]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {
        "step_s": med("perf/step_s"),
        "rollout_s": med("time/rollout_s"),  # the loop's wait for the rollout
        "update_s": med("time/update_s"),
        "rollout_idle": med("perf/rollout_idle_frac"),
        "trainer_idle": med("perf/trainer_idle_frac"),
        "logprob_diff": med("train/logprob_diff"),
        "before": summary["eval"]["initial"]["pass@1"],
        "after": summary["eval"]["final"]["pass@1"],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--eval-problems", type=int, default=200)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both runs")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fw-bench-async-"))
    print(f"machine: {os.cpu_count()} cores; runs in {root}", flush=True)
    res = {k: one_run(k, args.steps, args.eval_problems, root / f"staleness-{k}", args.set) for k in (0, 1)}
    sync, off = res[0], res[1]
    print(f"\nSmolLM2-135M-Instruct, vLLM rollout and trainer on one core each, {args.steps} steps per run")
    if args.set:
        print("overrides: " + " ".join(args.set))
    head = ("s/step", "rollout wait", "update", "rollout idle", "trainer idle", "logprob diff", "pass@1", "wall s")
    print(f"{'run':<18}" + "".join(f"{h:>14}" for h in head))
    for name, r in (("on-policy", sync), ("max_staleness=1", off)):
        cells = [f"{r['step_s']:.2f}", f"{r['rollout_s']:.2f}", f"{r['update_s']:.2f}", f"{r['rollout_idle']:.2f}",
                 f"{r['trainer_idle']:.2f}", f"{r['logprob_diff']:.1e}", f"{r['before']:.3f}->{r['after']:.3f}",
                 f"{r['wall_s']:.0f}"]  # fmt: skip
        print(f"{name:<18}" + "".join(f"{c:>14}" for c in cells))
    ideal = max(sync["rollout_s"], sync["update_s"]) / (sync["rollout_s"] + sync["update_s"])
    print(f"\nasync / on-policy seconds per step: {off['step_s'] / sync['step_s']:.3f}x (ideal overlap {ideal:.3f}x)")
    gain = lambda r: r["after"] - r["before"]  # noqa: E731
    print(
        f"pass@1 gain: on-policy {gain(sync):+.3f}, async {gain(off):+.3f} (difference {gain(off) - gain(sync):+.3f})"
    )


if __name__ == "__main__":
    main()
