"""Learning rate: warmup + constant/linear/cosine schedule, times an adaptive scale driven by a training signal.

The adaptive controller watches one signal each step:
  kl         approximate KL between the policy before and after the step's passes (or k3 KL to the reference
             when beta > 0); `target` is an absolute KL. With one PPO pass and beta = 0 this KL is 0 by
             construction, so prefer `grad_norm` there.
  grad_norm  the pre-clip gradient norm per square root of the batch's mean |advantage|, compared with its own
             exponential moving average; `target` is the spike ratio (2.0 = a step at twice its recent average).
             Why per sqrt(mean |advantage|): the loss averages over every sequence, so the norm grows with the
             share of groups whose rewards differ. Raw, it doubled in 3 steps on the TRL example
             (tests/test_trl_example.py) as the first right answers appeared, and the controller cut the LR to
             0.03. Divided by the mean |advantage| it overcorrects: k informative groups' gradients add up to a
             norm near sqrt(k) (their directions differ), the mean |advantage| grows as k, so a step where one group
             of four has signal read as a spike. On 24 healthy runs of bench/vs_trl.py (628 steps, 4 x 8 samples,
             the demo and sparse tasks) that rule cut the LR 41 times in 20 runs, to 0.08 on one: the LR those
             runs learned at was a random fraction of the schedule's. Per sqrt(mean |advantage|) the step-to-step
             spread of the log-signal fell from 0.38 to 0.30.
             A step whose gradient is exactly zero (every advantage 0: each group's rewards were all equal) carries
             no signal and is not an observation: it neither moves the average nor counts as calm.
A cut needs a spike that persists or is severe: the signal above `target` x average on two observations in a row,
or above `target`^2 x average once, or not finite. One noisy step is not an instability: its update is already
bounded by `max_grad_norm`, and the optimizer's second moment absorbs it. (On the 628 healthy steps above this rule
cut nothing; one spike of target^2 or a rise that holds still cuts at once.) kl mode cuts on one observation above
its absolute target. A cut multiplies the scale by `cut`; when the signal is below half the target it recovers by
`recover` per step, up to 1: a multiplicative-decrease / slow-increase rule in the spirit of adaptive-KL PPO
(Schulman et al., 2017), applied to the LR instead of a KL coefficient.
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
    over: int = 0  # grad_norm: observations in a row above target (a spike that persists)

    def observe(self, kl: float, grad_norm: float, advantage_mass: float = 1.0) -> float:
        """Feed this step's signals (`advantage_mass`: the batch's mean |advantage|, whose square root the grad norm
        is divided by); returns the scale to use for the next step.

        >>> a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [a.observe(0, g) for g in (1.0, 1.0, 5.0)]  # 5x the average: severe, cut at once
        [1.0, 1.0, 0.5]
        >>> e = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [e.observe(0, g) for g in (1.0, 1.0, 2.5, 1.0, 2.5, 3.0)]  # 2.5x once is noise; twice in a row, a rise
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.5]
        >>> b = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [b.observe(0, g) for g in (0.0, 2.0, 0.0, 0.0, 2.5)]  # zero-gradient steps: no observation
        [1.0, 1.0, 1.0, 1.0, 1.0]
        >>> d = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [d.observe(0, g, m) for g, m in ((0.2, 0.05), (0.4, 0.1), (1.0, 0.5))]  # more signal, not a spike
        [1.0, 1.0, 1.0]
        >>> f = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
        >>> [f.observe(0, g, m) for g, m in ((1.0, 1.0), (1.4, 0.25), (1.0, 1.0))]  # one group of four has signal
        [1.0, 1.0, 1.0]
        """
        c = self.cfg
        if c.signal == "grad_norm" and (grad_norm == 0.0 or advantage_mass <= 0.0):
            return self.scale  # no gradient, no signal: hold, and keep the average of real steps
        signal = grad_norm / math.sqrt(advantage_mass) if c.signal == "grad_norm" else grad_norm
        level = self._level(kl, signal)
        if self._spike(level):
            self.scale = max(c.min_scale, self.scale * c.cut)
            self.cuts += 1
        elif level < 0.5:
            self.scale = min(1.0, self.scale * c.recover)
        return self.scale

    def _spike(self, level: float) -> bool:
        """kl: above target. grad_norm: not finite, above target^2, or above target on two observations in a row."""
        if self.cfg.signal == "kl":
            return level > 1.0
        self.over = self.over + 1 if level > 1.0 else 0
        if level > self.cfg.target or self.over >= 2:  # level > target: the signal above target^2 x its average
            self.over = 0
            return True
        return False

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
        self.over = state.get("over", 0)  # absent from checkpoints written before the two-in-a-row rule
