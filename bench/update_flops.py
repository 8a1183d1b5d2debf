"""The update's speed and achieved FLOP/s, plain vs shared-prefix packing, against this machine's matmul peaks.

One real scored batch of the speed issue's task (bench/arith_task.py: SmolLM2-135M-Instruct, 4 prompts x 8
samples, <= 32 new tokens, T = 0.7, seeded), sampled once with the hf backend; then `Trainer.update` on it with
`update.shared_prefix` off and on, alternating `--repeats` times after a warm-up, so machine noise hits both.
Each update starts from the same weights (a fresh Trainer per measurement).

FLOPs are counted the way MFU is: 6 x parameters (outside the embedding; the LM head counted on the completion
positions only, where it runs) x the tokens the step must process, each distinct token once (a group's prompt
once, every completion token); the plain path does more work than that (its prompts G times) and gets no credit
for it. The peaks are a 2048^2 matmul in fp32 and bf16, measured in this run with the same threads.
Usage: python bench/update_flops.py [--repeats 3] [--threads N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from arith_task import PRESET, TASK  # bench/ is on sys.path when this file runs as a script

from forge.advantages import group_advantages
from forge.compose import trainer as Trainer
from forge.config import apply_overrides
from forge.models import format_prompt_fn, load_policy
from forge.presets import get_preset
from forge.recipes.grpo import update_micro_batch
from forge.records import Rollouts
from forge.rewards.math import completion_matches
from forge.rollout import HFBackend, SamplingParams
from forge.shared_prefix import PackingCost
from forge.tasks.arith import generate_arithmetic


def matmul_tflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - t0) / 1e12


def real_batch(cfg, model, tok) -> tuple[Rollouts, torch.Tensor]:
    """The task's first prompts, 8 seeded samples each, rewarded 1 where the completion's answer is right."""
    train, _ = generate_arithmetic(cfg.data, seed=cfg.seed)
    rows = train[: cfg.rollout.prompts_per_step]
    fmt, r = format_prompt_fn(tok, cfg.model), cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, n=r.group_size, seed=0)
    ro = HFBackend(model, tok).generate([fmt(row["prompt"]) for row in rows], params)
    answers = [row["answer"] for row in rows for _ in range(r.group_size)]
    rewards = torch.tensor([float(completion_matches(t, a)) for t, a in zip(ro.texts, answers, strict=True)])
    advantages = group_advantages(rewards, r.group_size, cfg.algo.advantage)
    return ro, advantages  # what an update takes


def model_flops(model, batch: tuple[Rollouts, torch.Tensor]) -> float:
    """6 x body parameters x distinct tokens + 6 x LM-head parameters x completion tokens (fwd + bwd)."""
    body = PackingCost.of(model).per_token / 2  # parameters outside the embedding and the LM head
    head = model.get_output_embeddings().weight
    ro = batch.rollouts
    group = ro.group_size
    prompt_tokens = int(ro.prompt_mask[::group].sum())
    completion_tokens = int(ro.completion_mask.sum())
    return 6.0 * body * (prompt_tokens + completion_tokens) + 6.0 * head.numel() * completion_tokens


def time_update(cfg, model, batch: tuple[Rollouts, torch.Tensor], shared: bool) -> float:
    cfg = copy.deepcopy(cfg)
    cfg.update.shared_prefix = shared
    trainer = Trainer(copy.deepcopy(model), cfg, total_steps=2, micro_update=update_micro_batch)
    t0 = time.perf_counter()
    trainer.update(*batch)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = apply_overrides(get_preset(PRESET), [*TASK, "update.autocast_bf16=false", *args.overrides])
    model, tok = load_policy(cfg.model, seed=0, trainable=True)
    batch = real_batch(cfg, model, tok)
    ro = batch.rollouts
    print(f"batch: {ro.num_completions} completions, prompt width {ro.prompt_ids.shape[1]}, completion width "
          f"{ro.completion_ids.shape[1]}, {int(ro.completion_mask.sum())} completion tokens; "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    time_update(cfg, model, batch, True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for shared in (False, True):
            times[shared].append(time_update(cfg, model, batch, shared))
    flops = model_flops(model, batch)
    peak32, peak16 = matmul_tflops(torch.float32), matmul_tflops(torch.bfloat16)
    print(f"matmul peak: fp32 {peak32:.3f} TFLOP/s, bf16 {peak16:.3f} TFLOP/s; update = {flops / 1e12:.3f} TFLOP")
    bf16_units = peak16 > peak32  # without bf16 units (AVX2 CPUs) bf16 matmuls are emulated, far below fp32
    print(f"{'update':<16}{'s (median)':>12}{'TFLOP/s':>10}{'% fp32 peak':>13}{'% bf16 peak':>13}")
    for shared, name in ((False, "plain"), (True, "shared prefix")):
        s = statistics.median(times[shared])
        rate = flops / s / 1e12
        of_bf16 = f"{100 * rate / peak16:>12.1f}%" if bf16_units else f"{'n/a':>13}"
        print(f"{name:<16}{s:>12.2f}{rate:>10.3f}{100 * rate / peak32:>12.1f}%{of_bf16}")
    if not bf16_units:
        print("no bf16 matmul units here (bf16 is slower than fp32): the update runs in fp32 (forge/precision.py)")
    speedup = statistics.median(times[False]) / statistics.median(times[True])
    print(f"shared prefix: {speedup:.2f}x faster than plain")


if __name__ == "__main__":
    main()
