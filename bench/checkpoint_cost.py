"""Checkpoint cost, synchronous vs asynchronous, measured in one process on a preset's real trainer state.

Builds the preset's update rank in-process (`forge.workers.TrainerWorker`: the policy, AdamW, the LR controller;
for `smollm2-arith` SmolLM2-135M in fp32), trains one update on a synthetic batch so AdamW holds its moments, then
saves the same trainer state `--repeats` times each way into a temporary `checkpoints/` directory:

- synchronous (`checkpoint.async_save=false`): the seconds `save` + `wait_saved` take (all of it stalls training);
- asynchronous: the stall is the seconds `save` takes plus what the next update's optimizer step waited for the
  background host copy (reported by the save); one update step runs while the background thread copies and
  writes, then `wait_saved` (the write's own seconds come from its report).

Prints the medians, the stall/sync ratio (issue 19's acceptance: <= 10%), the checkpoint bytes, and the update
step's seconds alone vs while a save is written (the background writer competes for the same cores).
Usage: python bench/checkpoint_cost.py [--preset smollm2-arith] [--repeats 3] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from forge.advantages import group_advantages
from forge.compose import trainer_worker as TrainerWorker
from forge.config import RunConfig, apply_overrides
from forge.presets import get_preset
from forge.recipes.grpo import update_micro_batch
from forge.records import Rollouts


def synthetic_batch(cfg: RunConfig, vocab: int, prompts: int = 2, prompt_len: int = 24) -> tuple[Rollouts, torch.Tensor]:
    """B prompts x G completions of random tokens (max_new_tokens long) with random rewards; seeded."""
    g, t = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    n = prompts * g
    gen = torch.Generator().manual_seed(0)
    rollouts = Rollouts(
        prompt_ids=torch.randint(0, vocab, (n, prompt_len), generator=gen),
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.long),  # [N, P]
        completion_ids=torch.randint(0, vocab, (n, t), generator=gen),
        completion_mask=torch.ones(n, t, dtype=torch.long),  # [N, T]
        sampling_logprobs=torch.zeros(n, t),
        texts=[""] * n,
        finish_reasons=["length"] * n,
        group_size=g,
        policy_version=0,
        prompts=[""] * n,
    )
    rewards = torch.rand(n, generator=gen).round()
    adv = group_advantages(rewards, g, cfg.algo.advantage)
    return rollouts, adv  # what an update takes


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(preset: str, repeats: int, overrides: list[str]) -> dict[str, list[float]]:
    cfg = apply_overrides(get_preset(preset), ["rollout.prompts_per_step=2", *overrides])
    w = TrainerWorker(cfg, micro_update=update_micro_batch)
    batch = synthetic_batch(cfg, w.trainer.unwrapped.config.vocab_size)
    out: dict[str, list[float]] = {k: [] for k in ("sync", "stall", "write", "step_alone", "step_during", "bytes")}
    with tempfile.TemporaryDirectory(prefix="forgeweave-ckpt-bench-") as d:
        root = str(Path(d) / "checkpoints")
        out["step_alone"].append(timed(lambda: w.step(*batch)))  # AdamW now holds its moments
        for i in range(repeats):
            cfg.checkpoint.async_save = False
            out["sync"].append(timed(lambda: (w.save(root, 2 * i + 1, {}, None), w.wait_saved())))  # noqa: B023
            cfg.checkpoint.async_save = True
            out["stall"].append(timed(lambda: w.save(root, 2 * i + 2, {}, None)))  # noqa: B023
            out["step_during"].append(timed(lambda: w.step(*batch)))
            report = w.wait_saved()
            out["stall"][-1] += report.stall_seconds  # the update's optimizer step waited for the host copy
            out["write"].append(report.seconds)
            out["bytes"].append(float(report.bytes))
            out["step_alone"].append(timed(lambda: w.step(*batch)))
    out["step_alone"] = out["step_alone"][1:]  # the first step also allocated AdamW's state
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-arith")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    m = {k: statistics.median(v) for k, v in measure(args.preset, args.repeats, args.overrides).items()}
    print(f"preset {args.preset}: checkpoint of {m['bytes'] / 1e6:.0f} MB, median of {args.repeats} saves each way")
    print(f"  synchronous save (training waits for all of it)   {m['sync']:8.2f} s")
    print(f"  asynchronous save: stall (training waited)        {m['stall']:8.2f} s")
    print(f"  asynchronous save: background write               {m['write']:8.2f} s")
    print(f"  stall / synchronous                               {m['stall'] / m['sync']:8.1%}   (acceptance <= 10%)")
    print(f"  update step alone / during a background write     {m['step_alone']:8.2f} s / {m['step_during']:.2f} s")


if __name__ == "__main__":
    main()
