"""Per-stage time breakdown of GRPO steps (rollout / reward / update / evaluate), from a real short run.

Runs a preset for a few steps (no checkpoints, one eval) and prints seconds per stage per step and the share.
Also compares the update in fp32 vs bf16 autocast with completion-only logits in the same run.
Usage: python bench/step_breakdown.py [--preset smollm2-arith] [--steps 3] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from forge.config import apply_overrides
from forge.presets import get_preset
from forge.recipes.grpo import run
from forge.tracking import read_metrics


def breakdown(preset: str, steps: int, overrides: list[str]) -> dict[str, float]:
    cfg = apply_overrides(
        get_preset(preset),
        [f"steps={steps}", "eval.every=0", "eval.max_problems=16", "eval.k=0", "checkpoint.every=0", *overrides],
    )
    with tempfile.TemporaryDirectory() as d:
        run(cfg, Path(d) / "bench", progress=False)
        rows = read_metrics(Path(d) / "bench" / "metrics.jsonl")[1:]
    keys = ("rollout", "reward", "update")
    per_step = {k: sum(r[f"time/{k}_s"] for r in rows) / len(rows) for k in keys}
    per_step["update_tokens_per_s"] = sum(r["perf/update_tokens_per_s"] for r in rows) / len(rows)
    per_step["rollout_tokens_per_s"] = sum(r["perf/rollout_tokens_per_s"] for r in rows) / len(rows)
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-arith")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    fast = breakdown(args.preset, args.steps, args.overrides)
    slow = breakdown(
        args.preset,
        args.steps,
        [
            "update.autocast_bf16=false",
            "update.logits_completion_only=false",
            "rollout.autocast_bf16=false",
            *args.overrides,
        ],
    )
    print(f"preset {args.preset}, {args.steps} steps, seconds per step (mean)")
    print(f"{'stage':<12}{'fp32 full logits':>18}{'bf16 + compl. logits':>22}{'speed-up':>10}")
    for k in ("rollout", "reward", "update"):
        print(f"{k:<12}{slow[k]:>18.2f}{fast[k]:>22.2f}{slow[k] / max(fast[k], 1e-9):>9.2f}x")
    ts, tf = (
        sum(slow[k] for k in ("rollout", "reward", "update")),
        sum(fast[k] for k in ("rollout", "reward", "update")),
    )
    print(f"{'step':<12}{ts:>18.2f}{tf:>22.2f}{ts / tf:>9.2f}x")
    print(
        f"update tokens/s: {slow['update_tokens_per_s']:.0f} -> {fast['update_tokens_per_s']:.0f}; "
        f"rollout tokens/s: {slow['rollout_tokens_per_s']:.0f} -> {fast['rollout_tokens_per_s']:.0f}"
    )


if __name__ == "__main__":
    main()
