"""Policy-gradient losses for GRPO and its variants (math in shared/reference/grpo.md).

Every loss returns the *contribution of one micro-batch* to the step's loss, already divided by a
normaliser computed over the whole step (all micro-batches, all ranks): summing the contributions
gives the same number however the step's batch was split. `StepTotals` carries those global counts.

Aggregation per loss type:
  grpo     sequence mean: mean_i (sum_t m L / sum_t m)          (original GRPO; biased toward short answers)
  dr_grpo  fixed horizon: sum m L / (N * T_max)                 (Dr. GRPO)
  dapo     token mean over the step, clip-higher via eps_high, dual clip for A < 0
  gspo     one sequence-level ratio exp(mean_t (logp - logp_old)), sequence mean
  cispo    -sg(min(r, eps_max)) * A * logp, token mean
Optional k3 KL to the reference (beta > 0) is added per token and aggregated like the policy term.

Off-policy correction (`algo.is_correction=tis`, for asynchronous GRPO and sampler/trainer mismatch): the tokens
were sampled by a policy mu (an older version, or the same weights in another engine), while the ratio above is
taken against pi_old, the trainer's policy at the start of the update. Each token's policy term is multiplied by
the truncated importance weight w_t = min(exp(logp_old_t - logp_mu_t), C) (stop-gradient; C = `algo.is_cap`),
the token-level TIS correction of Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL
training"), as TRL's vLLM importance-sampling correction and verl's rollout correction apply it. The KL term is
not reweighted. `importance_weights` computes w.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge.config import AlgoConfig

MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class StepTotals:
    """Global counts of one update step, used as loss normalisers."""

    sequences: int  # N over the whole step
    tokens: int  # completion tokens over the whole step
    max_len: int  # T_max (completion horizon)


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar, this micro-batch's share of the step loss
    kl: torch.Tensor  # [n, T] per-token KL (k3 to ref when beta > 0, else approx KL to logp_old)
    clipped_low: torch.Tensor  # [n, T] bool
    clipped_high: torch.Tensor  # [n, T] bool


def policy_loss(
    logp: torch.Tensor,  # [n, T] current policy log-probs of the sampled tokens
    old_logp: torch.Tensor,  # [n, T] policy that sampled (detached)
    advantages: torch.Tensor,  # [n]
    mask: torch.Tensor,  # [n, T] completion mask
    cfg: AlgoConfig,
    totals: StepTotals,
    ref_logp: torch.Tensor | None = None,  # [n, T] reference policy, required when beta > 0
    is_weight: torch.Tensor | None = None,  # [n, T] off-policy weight of each token's policy term (see above)
) -> LossOutput:
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [n, 1]
    log_ratio = (logp - old_logp.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if cfg.loss == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        # token-wise form with a sequence-level value: s_i * exp(logp - sg(logp)) keeps the gradient per token
        log_ratio = seq_log_ratio.detach() + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    per_token, low, high = _per_token_objective(ratio, adv, logp, cfg)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    approx_kl = (ratio.detach() - 1) - log_ratio.detach()
    kl = approx_kl
    if cfg.beta > 0:
        assert ref_logp is not None, "beta > 0 needs reference log-probs"
        d = ref_logp.detach() - logp
        kl = torch.exp(d) - d - 1  # k3 estimator, >= 0
        per_token = per_token + cfg.beta * kl
    loss = _aggregate(per_token, mask, cfg.loss, totals)
    return LossOutput(loss=loss, kl=kl.detach(), clipped_low=low & mask.bool(), clipped_high=high & mask.bool())


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated token-level importance weights min(pi_old / mu, cap), [n, T]; 1 where both agree.

    >>> importance_weights(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -3.0]]), cap=2.0)
    tensor([[1., 2.]])
    """
    log_w = (old_logp.detach() - sampler_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_w).clamp(max=cap)


def _per_token_objective(ratio, adv, logp, cfg: AlgoConfig):
    if cfg.loss == "cispo":
        weight = ratio.detach().clamp(max=cfg.cispo_eps_max)
        return -weight * adv * logp, torch.zeros_like(ratio, dtype=torch.bool), ratio.detach() > cfg.cispo_eps_max
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if cfg.loss == "dapo":
        per_token = torch.where(adv < 0, torch.min(per_token, -cfg.dual_clip * adv), per_token)
    r = ratio.detach()
    low = (r < 1 - cfg.eps_low) & (adv < 0)
    high = (r > 1 + cfg.eps_high) & (adv > 0)
    return per_token, low, high


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, kind: str, totals: StepTotals) -> torch.Tensor:
    if kind in ("grpo", "gspo"):
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / totals.sequences
    if kind == "dr_grpo":
        return (per_token * mask).sum() / (totals.sequences * totals.max_len)
    return (per_token * mask).sum() / max(totals.tokens, 1)
