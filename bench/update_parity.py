"""Does a forgeweave update step push the weights where TRL's would? One batch, two gradients, compared.

The reference is the textbook computation written out plainly, with TRL 1.16's definitions for its `dapo` loss
(`GRPOTrainer._compute_loss`): one padded fp32 forward of prompt + completion, logits / T, log-softmax, the
sampled tokens' log-probs, ratio exp(logp - sg(logp)) (exactly 1 on the first pass, so the clip is inactive),
per-token loss -ratio * A, summed over completion tokens and divided by the step's completion tokens. forgeweave's
gradient is the one its `Trainer.update` accumulates (micro-batching, shared-prefix packing, completion-only
logits, chunked log-softmax, bf16 autocast where asked), with clipping off so the raw gradient is compared.

For each variant it prints the cosine between the two gradients and the ratio of their norms: 1.0 and 1.0 mean
the update computes TRL's gradient (up to float rounding; bf16 autocast shows its own rounding here). Anything
else is a defect in the update, not in the sampler or the optimizer.

The batch is real: the smollm2-arith preset's prompts (or `--preset tiny`), sampled by forgeweave's hf sampler,
scored by the preset's verifiers, z-scored per group.
Usage: python bench/update_parity.py [--preset smollm2-arith] [--prompts 4] [--group 8] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform

import torch

from forge.advantages import group_advantages
from forge.config import RunConfig
from forge.records import Rollouts


def reference_gradient(model, ro: Rollouts, advantages: torch.Tensor, temperature: float) -> list[torch.Tensor]:
    """TRL's dapo gradient at ratio 1, computed plainly: [N] advantages, one padded fp32 forward, token mean."""
    model = copy.deepcopy(model).float()
    model.zero_grad(set_to_none=True)
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)  # [N, P + T]
    attn = torch.cat([ro.prompt_mask, ro.completion_mask], 1)
    positions = (attn.long().cumsum(1) - 1).clamp(min=0)  # left padding: real tokens from position 0, as generate
    P, T = ro.prompt_ids.shape[1], ro.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, P - 1 : P + T - 1]
    logp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ro.completion_ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())  # [N, T], exactly 1
    mask = ro.completion_mask.float()
    loss = (-ratio * advantages.unsqueeze(1) * mask).sum() / mask.sum()
    loss.backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def forgeweave_gradient(model, cfg: RunConfig, ro: Rollouts, advantages: torch.Tensor) -> list[torch.Tensor]:
    """The gradient forgeweave's trainer accumulates for this batch (no clipping, one pass, lr 0: no step)."""
    from forge.compose import trainer as Trainer
    from forge.recipes.grpo import update_micro_batch

    cfg = copy.deepcopy(cfg)
    cfg.update.max_grad_norm, cfg.update.num_iterations, cfg.update.lr = 0.0, 1, 1e-30
    cfg.update.adaptive.enabled, cfg.update.warmup_steps = False, 0
    trainer = Trainer(copy.deepcopy(model).float(), cfg, total_steps=1, micro_update=update_micro_batch)
    trainer.update(ro, advantages)
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.unwrapped.parameters()
    ]


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(cosine, |a| / |b|) of two gradients given as lists of per-parameter tensors."""
    fa = torch.cat([x.flatten().double() for x in a])
    fb = torch.cat([x.flatten().double() for x in b])
    cos = float(fa @ fb / (fa.norm() * fb.norm()).clamp(min=1e-300))
    return cos, float(fa.norm() / fb.norm().clamp(min=1e-300))


VARIANTS = {  # name -> overrides of the update section: each speed feature alone, then the preset's defaults
    "plain fp32 (no packing, full logits, one micro-batch)": dict(shared_prefix=False, logits_completion_only=False,
                                                                 micro_batch_size=10**6, autocast_bf16=False),
    "micro-batches of 4": dict(shared_prefix=False, micro_batch_size=4, autocast_bf16=False),
    "shared-prefix packing": dict(shared_prefix=True, autocast_bf16=False),
    "bf16 autocast": dict(shared_prefix=False, autocast_bf16=True),
    "the preset's settings": {},
}  # fmt: skip


def sample_batch(cfg: RunConfig, model, tok, prompts: int, group: int) -> tuple[Rollouts, torch.Tensor]:
    """A real step's batch: `prompts` train prompts x `group` samples from the hf sampler, scored, z-scored."""
    from forge.compose import data_sources
    from forge.data import build
    from forge.models import format_prompt_fn
    from forge.rewards.registry import resolve_verifiers
    from forge.rollout.base import SamplingParams
    from forge.rollout.hf import HFBackend

    count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    rows = build(data_sources(cfg), format_prompt_fn(tok, cfg.model), count).train[:prompts]
    r = cfg.rollout
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, group, seed=cfg.seed)
    ro = HFBackend(model, tok, autocast_bf16=r.autocast_bf16).generate([x["model_input"] for x in rows], params)
    expanded = [x for x in rows for _ in range(group)]
    rewards = torch.zeros(ro.num_completions)
    for _name, fn in resolve_verifiers(cfg.reward.verifiers, cfg.reward):
        cols = {k: [x[k] for x in expanded] for k in expanded[0] if k != "model_input"}
        rewards += torch.tensor([float(v or 0.0) for v in fn(ro.prompts, ro.texts, **cols)])
    return ro, group_advantages(rewards, group, cfg.algo.advantage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-arith")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    from flows.runs import resolve_config
    from forge.models import load_policy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    cfg = resolve_config(args.preset, None, ["algo.loss=dapo", "algo.beta=0", *args.set])  # what the reference is
    print(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}; torch {torch.__version__}")
    model, tok = load_policy(cfg.model, cfg.seed, trainable=False)
    ro, adv = sample_batch(cfg, model, tok, args.prompts, args.group)
    print(f"batch: {ro.num_completions} completions, {int(ro.completion_mask.sum())} tokens, "
          f"{int((adv != 0).sum())} with a non-zero advantage")  # fmt: skip
    if not bool((adv != 0).any()):  # the comparison needs a gradient, not real rewards
        print("every group's rewards are equal: comparing with seeded random 0/1 rewards instead")
        rewards = torch.bernoulli(torch.full((ro.num_completions,), 0.5), generator=torch.Generator().manual_seed(0))
        adv = group_advantages(rewards, args.group, cfg.algo.advantage)
    ref = reference_gradient(model, ro, adv, cfg.rollout.temperature)
    print(f"{'variant':<56}{'cosine':>12}{'norm ratio':>12}")
    for name, over in VARIANTS.items():
        v = copy.deepcopy(cfg)
        for k, val in over.items():
            setattr(v.update, k, val)
        cos, ratio = compare(forgeweave_gradient(model, v, ro, adv), ref)
        print(f"{name:<56}{cos:>12.6f}{ratio:>12.4f}", flush=True)


if __name__ == "__main__":
    main()
