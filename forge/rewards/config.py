"""`reward`: the reward stage's section (forge.workers.RewardWorker reads it; the teacher's is `distill`).

Kept apart from the reward modules that import torch: `forge.config` stays importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge.config_base import ranged, require
from forge.rewards.code_exec import CodeExecConfig
from forge.rewards.ensemble import RewardEnsembleConfig


@dataclass(kw_only=True)
class RewardConfig:
    verifiers: list[str] = field(default_factory=lambda: ["math_answer"])
    """Verifier names (built-ins: math_answer, format_integer, format_tags, code_exec) or import paths 'pkg.mod:fn'."""
    weights: list[float] = field(default_factory=list)
    """One weight per verifier; empty = all 1.0. Reward = sum(w_v * score_v), missing scores count as 0."""
    aggregate: Literal["weighted", "ensemble", "majority", "mean"] = "weighted"
    """weighted: the sum above; ensemble: P(correct | scores) from the label-free weak-verifier ensemble; majority:
    1 for the group's most common final answer, else 0 (TTRL); mean: the scores' average, NaN ignored."""
    ensemble: RewardEnsembleConfig = field(default_factory=RewardEnsembleConfig)
    """ensemble: the window, refits and model of the ensemble reward."""
    label_free: bool = False
    """Do not pass the reference answer column to verifiers (evaluation still scores against it)."""
    max_failing_steps: int = ranged(3, ">= 0", "(0 = never stop)")
    """Stop the run when a verifier raises on every item for this many steps in a row (0 = never stop)."""
    callables: list[str] = field(default_factory=list)
    """Entries of `verifiers` that were Python callables given to forge.train (module:qualname), not config names."""
    score_timeout_s: float = ranged(60.0, ">= 0", "seconds (0 = no limit)")
    """Seconds one verifier may take on one step's batch; past it the run stops with an error naming the verifier
    (a hung verifier cannot be cut off safely in-process). 0 = no limit."""
    code_exec: CodeExecConfig = field(default_factory=CodeExecConfig)
    """code_exec: the sandbox limits."""

    def check(self, prefix: str) -> None:
        w, n = self.weights, len(self.verifiers)
        why = f"has {len(w)} values for {n} verifiers: give one per verifier (or none)"
        require(not w or len(w) == n, f"{prefix}weights", why)
        why = "is empty, but reward.aggregate=ensemble combines verifiers: name them (or use aggregate=weighted)"
        require(bool(self.verifiers) or self.aggregate != "ensemble", f"{prefix}verifiers", why)
