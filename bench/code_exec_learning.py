"""Do the code presets learn? GRPO with the sandboxed `code_exec` reward, before -> after on held-out tasks.

Runs `smollm2-code` (or `--preset tiny-code`) with the plain recipe (no Prefect, no MLflow) for --steps steps and prints greedy pass@1 (all 5
hidden asserts pass) and the mean share of asserts passed on the 100 held-out problems at step 0 and at the end,
the per-kind pass@1 (smollm2-code), and what the sandbox cost (runs and seconds per step from the reward stage's timings).

    PYTHONPATH=. .venv/bin/python bench/code_exec_learning.py --steps 12
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

from forge.presets import get_preset
from forge.recipes.grpo import run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smollm2-code", choices=["smollm2-code", "tiny-code"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0, help="override update.lr (0 = the preset's)")
    ap.add_argument("--run-dir", default="", help="keep the run here (default: a temporary directory)")
    args = ap.parse_args()
    cfg = get_preset(args.preset)
    cfg.steps, cfg.seed = args.steps, args.seed
    cfg.eval.every, cfg.checkpoint.every, cfg.checkpoint.hf_model = 0, 0, False  # eval at step 0 and the last step
    cfg.tracking.mlflow = False
    cfg.eval.num_samples_saved = cfg.eval.max_problems  # keep every sample, for the per-kind table
    if args.lr:
        cfg.update.lr = args.lr
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="code-exec-bench-"))
    start = time.perf_counter()
    run(cfg, run_dir, progress=False)
    elapsed = time.perf_counter() - start
    kinds = {
        r["prompt"]: r.get("kind", "?") for r in map(json.loads, Path(cfg.data.eval_source).read_text().splitlines())
    }
    reports = sorted((run_dir / "eval").glob("step-*.json"))
    first, last = (json.loads(p.read_text()) for p in (reports[0], reports[-1]))
    print(
        f"{args.preset}, {cfg.steps} steps of {cfg.rollout.prompts_per_step}x{cfg.rollout.group_size}, seed {args.seed}"
    )
    print(f"greedy pass@1 ({first['problems']} held-out): {first['pass@1']:.3f} -> {last['pass@1']:.3f}")
    print(f"mean reward (share of asserts): {first['mean_reward']:.3f} -> {last['mean_reward']:.3f}")
    _per_kind(run_dir, kinds)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    print("train reward/mean by step:", " ".join(f"{r['reward/mean']:.2f}" for r in train))
    reward_s = [r["time/reward_s"] for r in train if "time/reward_s" in r]
    if reward_s:
        print(
            f"reward stage: {sum(reward_s) / len(reward_s):.2f} s/step for {cfg.rollout.prompts_per_step * cfg.rollout.group_size} completions"
        )
    print(f"elapsed {elapsed:.0f} s; run dir {run_dir}")


def _per_kind(run_dir: Path, kinds: dict[str, str]) -> None:
    """Per-kind pass@1 at the first and last eval, from the samples each report stores (all 100 when saved)."""
    reports = sorted((run_dir / "eval").glob("step-*.json"))
    for p in (reports[0], reports[-1]):
        samples = json.loads(p.read_text())["samples"]
        by = collections.defaultdict(list)
        for s in samples:
            by[kinds.get(s["prompt"], "?")].append(s["correct"])
        print(p.stem, {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by.items())})


if __name__ == "__main__":
    main()
