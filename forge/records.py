"""Named, frozen records that cross stage boundaries.

Legend used in shape comments everywhere: B prompts, G samples per prompt, N = B*G completions,
T completion tokens (right-padded), P prompt tokens (left-padded), V verifiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Rollouts:
    """Completions sampled by a rollout backend for one step. Rows are grouped: row i belongs to prompt i // G."""

    prompt_ids: torch.Tensor  # [N, P] left-padded prompt token ids
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded sampled tokens (eos included when sampled)
    completion_mask: torch.Tensor  # [N, T] 1 on sampled tokens up to and including eos
    sampling_logprobs: torch.Tensor  # [N, T] log-prob of each sampled token under the sampler (0 on padding)
    texts: list[str]  # [N] decoded completions (special tokens stripped)
    finish_reasons: list[str]  # [N] "stop" (eos sampled) or "length" (hit max_new_tokens)
    group_size: int  # G
    policy_version: int  # version of the weights that sampled these
    prompts: list[str] = field(default_factory=list)  # [N] prompt text as given to the model (template applied)
    seconds: float = 0.0  # the sampler's own time for this batch (its busy time, not the caller's wait)

    @property
    def num_completions(self) -> int:
        return self.completion_ids.shape[0]


@dataclass(frozen=True)
class ScoredBatch:
    """Rollouts with rewards and advantages: what the update stage consumes."""

    rollouts: Rollouts
    verifier_names: list[str]  # [V]
    scores: torch.Tensor  # [N, V] per-verifier scores; NaN where a verifier failed or returned None
    rewards: torch.Tensor  # [N] aggregated reward
    advantages: torch.Tensor  # [N] per-completion advantage (broadcast over its tokens)
    verifier_failures: dict[str, int]  # verifier name -> items it raised on or returned None for
    verifier_errors: dict[str, str] = field(default_factory=dict)  # verifier name -> first error text (if any)
    verifier_errored: dict[str, int] = field(default_factory=dict)  # verifier name -> items it raised on / scored badly
    reward_metrics: dict[str, float] = field(default_factory=dict)  # the aggregation's own `reward/...` figures


@dataclass(frozen=True)
class Scored:
    """What the reward stage returns: the scored batch and, on steps the label-free ensemble was refit, its report."""

    batch: ScoredBatch
    ensemble_report: dict | None = None


@dataclass(frozen=True)
class UpdateStats:
    """What one update step did (means over micro-batches and PPO passes)."""

    loss: float
    kl: float  # k3 KL to reference when beta > 0, else approximate KL to the sampling policy
    clip_frac_low: float
    clip_frac_high: float
    entropy: float
    grad_norm: float  # pre-clip global norm (mean over optimizer steps)
    lr: float  # LR actually used (schedule x adaptive scale)
    lr_scale: float  # adaptive controller multiplier
    tokens: int  # completion tokens trained on
    seconds: float
    policy_version: int  # version after this update
    sync_seconds: float = 0.0  # new weights -> rollout model: rank 0 publishes, the pipeline loads (0 in-process)
    logprob_diff: float = 0.0  # mean |log pi_old - log mu| over the step's tokens: trainer vs sampler mismatch
    is_truncated_frac: float = 0.0  # tis: share of tokens whose importance weight hit algo.is_cap
    skipped: int = 0  # optimizer steps (PPO passes) skipped because the loss or gradient norm was not finite
