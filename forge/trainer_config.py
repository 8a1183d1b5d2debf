"""`update` and `algo`: the trainer's sections (forge/trainer.py, forge/losses.py and the recipe read them).

Kept apart from forge/trainer.py, which imports torch: `forge.config` stays importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge.config_base import ranged, require


@dataclass(kw_only=True)
class AdaptiveConfig:
    """`update.adaptive`: the controller's settings (the defaults are written here only)."""

    enabled: bool = True
    """Adaptive LR controller: shrink the LR when the training signal spikes past its target, recover slowly."""
    signal: Literal["kl", "grad_norm"] = "grad_norm"
    """Signal the controller watches: KL of the step (see forge/lr.py), or the pre-clip grad norm."""
    target: float = ranged(2.0, "> 0")
    """kl: absolute KL target (one observation above it cuts); grad_norm: spike ratio of the norm per sqrt(mean
    |advantage|) over its moving average (a cut: above it twice in a row, or above its square once)."""
    cut: float = ranged(0.5, "in (0, 1]")
    """Multiply the LR scale by this when the signal exceeds target."""
    recover: float = ranged(1.1, ">= 1")
    """Multiply the LR scale by this (up to 1.0) on each step the signal is below target/2."""
    min_scale: float = ranged(0.01, "in (0, 1]")
    """The LR scale never falls below this."""
    ema_beta: float = ranged(0.9, "in [0, 1)")
    """grad_norm: weight of the old value in the norm's exponential moving average."""


@dataclass(kw_only=True)
class AlgoConfig:
    advantage: Literal["zscore", "mean", "loo"] = "zscore"
    """Advantage estimator: group z-score (GRPO), mean-only (Dr. GRPO), leave-one-out (RLOO)."""
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    """Policy loss (see shared/reference/grpo.md)."""
    eps_low: float = ranged(0.2, "in [0, 1)")
    """Lower clip range of the importance ratio."""
    eps_high: float = ranged(0.2, ">= 0")
    """Upper clip range of the importance ratio (DAPO uses 0.28)."""
    dual_clip: float = ranged(3.0, "> 1", "(the DAPO dual-clip constant)")
    """DAPO dual-clip constant c for negative advantages."""
    cispo_eps_max: float = ranged(4.0, "> 0")
    """CISPO: upper cap of the (stop-gradient) importance weight."""
    beta: float = ranged(0.0, ">= 0", "(0 = no KL term)")
    """k3 KL penalty to the reference policy; 0 = no reference model is loaded."""
    max_staleness: int = ranged(0, ">= 0", "(0 = on-policy)")
    """Asynchronous GRPO: the rollout of step t+k may run during the update of step t, from weights at most k
    versions older than the trainer's (0 = on-policy: rollout and update take turns). k >= 1 runs on Ray actors."""
    is_correction: Literal["auto", "none", "tis"] = "auto"
    """Off-policy correction with the sampler's log-probs: tis = truncated token-level importance weights
    min(pi_old/pi_sampler, is_cap) on the policy loss; auto = tis when max_staleness > 0, else none."""
    is_cap: float = ranged(2.0, ">= 1", "(a weight cap below 1 shrinks on-policy tokens)")
    """tis: upper bound of the importance weight."""

    @property
    def tis(self) -> bool:
        """Whether the truncated importance-sampling correction is on (resolves is_correction=auto)."""
        return self.is_correction == "tis" or (self.is_correction == "auto" and self.max_staleness > 0)


@dataclass(kw_only=True)
class UpdateConfig:
    lr: float = ranged(1e-3, "> 0")
    """Peak learning rate (AdamW)."""
    weight_decay: float = ranged(0.0, ">= 0")
    """AdamW weight decay."""
    adam_betas: list[float] = ranged([0.9, 0.99], "in [0, 1)", ", e.g. [0.9, 0.99]")
    """AdamW betas."""
    max_grad_norm: float = ranged(1.0, ">= 0", "(0 = no clipping)")
    """Clip the global gradient norm to this (0 = no clipping)."""
    micro_batch_size: int = ranged(16, ">= 1")
    """Sequences per forward/backward; the step's gradient is accumulated over micro-batches."""
    num_iterations: int = ranged(1, ">= 1")
    """PPO passes over each batch (the ratio is exactly 1 on the first)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup."""
    warmup_steps: int = ranged(0, ">= 0")
    """Linear warmup steps."""
    min_lr_ratio: float = ranged(0.1, "in [0, 1]")
    """linear/cosine: final LR as a fraction of the peak."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """Adaptive LR controller (forge/lr.py)."""
    autocast_bf16: bool = False
    """Run forward/backward under bf16 autocast (fp32 master weights and fp32 log-softmax kept)."""
    logits_completion_only: bool = True
    """Apply the LM head only to completion positions (the loss never reads prompt logits)."""
    shared_prefix: bool = True
    """Pack each micro-batch into one padding-free row in which each group's prompt is computed once (a block
    mask keeps every completion to its own context; forge/shared_prefix.py) where that costs fewer FLOPs; same
    log-probs up to float rounding."""
    num_processes: int = ranged(0, ">= 0", "(0 = from the Weaver plan)")
    """Update processes: 0 = what Weaver's plan gives the update pool (1 on a CPU machine); >1 = that many rank
    actors on Ray forming one torch.distributed group (gloo on CPU, NCCL on GPUs); rank 0 hands the new weights
    to the rollout actors through Ray's object store."""
    max_skipped_steps: int = ranged(3, ">= 1")
    """A step whose loss or gradient norm is not finite is skipped (no optimizer step, `train/skipped_steps`);
    this many in a row stop the run."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """With several update processes: DDP (replicated weights) or FSDP full shard (for models that do not fit one
    device; torch FSDP2, on CPU too). No effect with one process."""

    def check(self, prefix: str) -> None:
        require(len(self.adam_betas) == 2, f"{prefix}adam_betas", "needs two values, e.g. [0.9, 0.99]")
