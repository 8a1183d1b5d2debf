"""The pieces GRPO's policy losses are built from (math in shared/reference/grpo.md); the recipe
(`forge.recipes.grpo.grpo_loss`) picks them by name and shows how they combine.

Per-token objectives, each [n, T] -> ([n, T] loss, [n, T] clipped low, [n, T] clipped high):
  clipped_objective   PPO clip: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)        (GRPO, Dr. GRPO, GSPO)
  dual_clip_objective the PPO clip, then min(L, -c A) where A < 0                          (DAPO)
  cispo_objective     -sg(min(r, eps_max)) * A * logp                                      (CISPO)
Normalisers, each returning *this micro-batch's share* of the step loss, divided by counts taken over the whole
step (all micro-batches, all ranks: `StepTotals`), so summing the shares gives the same number however the step's
batch was split:
  sequence_mean   mean_i (sum_t m L / sum_t m)    original GRPO (biased toward short answers), GSPO; an episode of
                                                  several sequences is one i, its tokens all of theirs
  horizon_mean    sum m L / (N * T_max)           Dr. GRPO
  token_mean      sum m L / sum m                 DAPO, CISPO
`sequence_log_ratio` is GSPO's one ratio per sequence; `k3_kl` the KL estimator to the reference policy;
`topk_reverse_kl` / `topk_forward_kl` the exact KL to a distillation teacher over its top k tokens
(`distill.topk`, `distill.divergence`);
`importance_weights` the truncated token-level correction (TIS) for tokens sampled by another policy mu (an older
version, or the same weights in another engine): w_t = min(exp(logp_old_t - logp_mu_t), C), stop-gradient,
the correction of Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL training"), as
TRL's vLLM importance-sampling correction and verl's rollout correction apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge.trainer_config import AlgoConfig

MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-20 before exp: one wild token cannot overflow the step


@dataclass(frozen=True)
class StepTotals:
    """The counts the loss normalisers divide by: the update step's, over all micro-batches and ranks, and (where an
    episode is several training sequences, `forge.sequences`) the micro-batch's rows' episodes'."""

    sequences: int  # N over the whole step: episodes (an episode of several sequences counts once)
    tokens: int  # loss tokens over the whole step
    max_len: int  # T_max (completion horizon)
    row_tokens: torch.Tensor | None = None  # [n] the loss tokens of each row's episode (all its sequences); None:
    # each row is its episode. The sequence mean divides a row's loss sum by it, so an episode counts once.


@dataclass(frozen=True)
class LossOutput:
    """One micro-batch's loss and the per-token figures the update reports."""

    loss: torch.Tensor  # scalar, this micro-batch's share of the step loss
    kl_old: torch.Tensor  # [n, T] approximate KL to pi_old, (r - 1) - log r (0 on the first pass)
    kl_ref: torch.Tensor | None  # [n, T] k3 KL to the reference policy (beta > 0), else None
    clipped_low: torch.Tensor  # [n, T] bool
    clipped_high: torch.Tensor  # [n, T] bool


def clipped_objective(ratio, adv, logp, cfg: AlgoConfig):
    """PPO's clipped surrogate, negated (a loss). [n, T] ratio, [n, 1] advantages."""
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    r = ratio.detach()
    return per_token, (r < 1 - cfg.eps_low) & (adv < 0), (r > 1 + cfg.eps_high) & (adv > 0)


def dual_clip_objective(ratio, adv, logp, cfg: AlgoConfig):
    """DAPO: the clipped surrogate, bounded by -c * A for negative advantages (c = algo.dual_clip)."""
    per_token, low, high = clipped_objective(ratio, adv, logp, cfg)
    return torch.where(adv < 0, torch.min(per_token, -cfg.dual_clip * adv), per_token), low, high


def cispo_objective(ratio, adv, logp, cfg: AlgoConfig):
    """CISPO: a REINFORCE term weighted by the stop-gradient ratio capped at algo.cispo_eps_max (never zeroed)."""
    weight = ratio.detach().clamp(max=cfg.cispo_eps_max)
    return -weight * adv * logp, torch.zeros_like(ratio, dtype=torch.bool), ratio.detach() > cfg.cispo_eps_max


def sequence_mean(per_token, mask, totals: StepTotals) -> torch.Tensor:
    tokens = mask.sum(1).clamp(min=1) if totals.row_tokens is None else totals.row_tokens.to(mask.dtype).clamp(min=1)
    per_seq = (per_token * mask).sum(1) / tokens  # an episode's sequences: each's share of its episode's mean
    return per_seq.sum() / totals.sequences


def horizon_mean(per_token, mask, totals: StepTotals) -> torch.Tensor:
    return (per_token * mask).sum() / (totals.sequences * totals.max_len)


def token_mean(per_token, mask, totals: StepTotals) -> torch.Tensor:
    return (per_token * mask).sum() / max(totals.tokens, 1)


def sequence_log_ratio(log_ratio, logp, mask) -> torch.Tensor:
    """GSPO: every token carries its sequence's mean log-ratio as value, s_i + logp - sg(logp), so the gradient
    still flows per token. [n, T]."""
    seq = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # [n, 1]
    return seq.detach() + logp - logp.detach()


def k3_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token, >= 0, with the gradient through `logp`.

    >>> float(k3_kl(torch.tensor([0.0]), torch.tensor([0.0])))
    0.0
    """
    d = ref_logp.detach() - logp
    return torch.exp(d) - d - 1


# the smallest probability the top-k divergence's rest bucket is given: 1 - sum(top k) is only known to ~1e-7 in fp32
REST_FLOOR = 1e-8


def topk_buckets(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The k + 1 buckets both top-k KLs sum over: q, p [n, T, k] (the probabilities of the teacher's k tokens) and
    q_rest, p_rest [n, T] (the rest of the vocabulary's mass, at least REST_FLOOR)."""
    q, p = student_logp.exp(), teacher_logp.exp()
    return q, p, (1 - q.sum(-1)).clamp(min=REST_FLOOR), (1 - p.sum(-1)).clamp(min=REST_FLOOR)


def topk_reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Reverse KL(student || teacher) at each position over k + 1 buckets: the teacher's k most likely tokens and one
    for the rest of the vocabulary. [n, T, k] log-probs of those tokens -> [n, T], >= 0, with the gradient through
    `student_logp`. Merging tokens into one bucket never raises a KL, so it is a lower bound of the full one, equal
    to it once the rest holds no mass; it is 0 only where the two agree on every bucket.

    >>> same = torch.log(torch.tensor([[[0.5, 0.25]]]))
    >>> float(topk_reverse_kl(same, same))
    0.0
    >>> round(float(topk_reverse_kl(torch.log(torch.tensor([[[0.25, 0.5]]])), same)), 4)  # 0.25 ln .5 + .5 ln 2
    0.1733
    """
    teacher_logp = teacher_logp.detach()
    q, p, q_rest, p_rest = topk_buckets(student_logp, teacher_logp)
    return (q * (student_logp - teacher_logp)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())


def topk_forward_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) over the same k + 1 buckets as `topk_reverse_kl`, [n, T, k] -> [n, T], >= 0:
    the teacher's cross-entropy on the student's buckets minus its entropy. Its gradient in the student's logits is
    q - p per bucket, as large as the student is wrong however sure it is.

    >>> same = torch.log(torch.tensor([[[0.5, 0.25]]]))
    >>> float(topk_forward_kl(same, same))
    0.0
    >>> round(float(topk_forward_kl(torch.log(torch.tensor([[[0.25, 0.5]]])), same)), 4)  # .5 ln 2 + .25 ln .5
    0.1733
    """
    teacher_logp = teacher_logp.detach()
    q, p, q_rest, p_rest = topk_buckets(student_logp, teacher_logp)
    return (p * (teacher_logp - student_logp)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())


# distill.divergence -> the top-k divergence the update adds
TOPK_DIVERGENCES = {"reverse": topk_reverse_kl, "forward": topk_forward_kl}


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated token-level importance weights min(pi_old / mu, cap), [n, T]; 1 where both agree.

    >>> importance_weights(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -3.0]]), cap=2.0)
    tensor([[1., 2.]])
    """
    log_w = (old_logp.detach() - sampler_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_w).clamp(max=cap)
