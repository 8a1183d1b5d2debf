"""Learning rate: warmup + constant/linear/cosine schedule, times an adaptive scale driven by a training signal.

The adaptive controller watches one signal each step:
  kl         approximate KL between the policy before and after the step's passes (or k3 KL to the reference
             when beta > 0); `target` is an absolute KL. With one PPO pass and beta = 0 this KL is 0 by
             construction, so prefer `grad_norm` there.
  grad_norm  the pre-clip gradient norm per unit of advantage (divided by the batch's mean |advantage|),
             compared with its own exponential moving average; `target` is the spike ratio (e.g. 2.0 = cut when
             it is twice its recent average). Per unit of advantage, because the loss averages over every
             sequence: the norm grows with the share of groups whose rewards differ, and early in a run that
             share climbs from a few percent to most of the batch within a few steps. Measured on the TRL example
             (tests/test_trl_example.py): the raw norm doubled in 3 steps as the first right answers appeared, the
             controller cut 5 times in 6 steps (LR scale 0.03) and mean reward stalled at 0.15 instead of 0.9;
             the norm per unit of advantage fell over the same steps. A step whose gradient is exactly zero (every
             advantage 0: each group's rewards were all equal) carries no signal and is not an observation: it
             neither moves the average nor counts as calm.
Above target the scale is multiplied by `cut`; when the signal is below half the target it recovers by
`recover` per step, up to 1. This is a simple multiplicative-decrease / slow-increase rule in the spirit of
adaptive-KL PPO (Schulman et al., 2017), applied to the LR instead of a KL coefficient.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from forge.trainer_config import AdaptiveConfig, UpdateConfig

__all__ = ["AdaptiveConfig", "scheduled_lr"]



def scheduled_lr(cfg: UpdateConfig, step: int, total_steps: int) -> float:
    """LR for 0-based `step` before the adaptive scale.

    >>> from forge.trainer_config import UpdateConfig
    >>> c = UpdateConfig(lr=1.0, warmup_steps=2, schedule="linear", min_lr_ratio=0.0)
    >>> [round(scheduled_lr(c, s, 6), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.667, 0.333, 0.0]
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (cfg.lr - floor) * (1 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class AdaptiveLR:
    """The controller: its settings (`cfg`) and its running state (scale, moving average, cuts so far)."""

    cfg: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    scale: float = 1.0
    ema: float | None = None
    cuts: int = 0

    def observe(self, kl: float, grad_norm: float, advantage_mass: float = 1.0) -> float:
        """Feed this step's signals (`advantage_mass`: the batch's mean |advantage|, which the grad norm is divided
        by); returns the scale to use for the next step.

        >>> a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [a.observe(0, g) for g in (1.0, 1.0, 5.0)]
        [1.0, 1.0, 0.5]
        >>> b = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [b.observe(0, g) for g in (0.0, 2.0, 0.0, 0.0, 2.5)]  # zero-gradient steps: no observation
        [1.0, 1.0, 1.0, 1.0, 1.0]
        >>> d = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [d.observe(0, g, m) for g, m in ((0.2, 0.05), (0.4, 0.1), (1.0, 0.5))]  # more signal, not a spike
        [1.0, 1.0, 1.0]
        """
        c = self.cfg
        if c.signal == "grad_norm" and (grad_norm == 0.0 or advantage_mass <= 0.0):
            return self.scale  # no gradient, no signal: hold, and keep the average of real steps
        level = self._level(kl, grad_norm / advantage_mass if c.signal == "grad_norm" else grad_norm)
        if level > 1.0:
            self.scale = max(c.min_scale, self.scale * c.cut)
            self.cuts += 1
        elif level < 0.5:
            self.scale = min(1.0, self.scale * c.recover)
        return self.scale

    def _level(self, kl: float, grad_norm: float) -> float:
        """Signal relative to its target (>1 = spike)."""
        c = self.cfg
        if c.signal == "kl":
            return kl / c.target
        if not math.isfinite(grad_norm):
            return math.inf
        if self.ema is None:
            self.ema = grad_norm
            return 0.5  # first observation: no baseline yet, hold
        level = grad_norm / (c.target * max(self.ema, 1e-12))
        self.ema = c.ema_beta * self.ema + (1 - c.ema_beta) * grad_norm
        return level

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """The running state (scale, moving average, cuts); the settings stay this run's (a resume may change them)."""
        self.scale, self.ema, self.cuts = state["scale"], state["ema"], state["cuts"]
