"""`reward`: the reward stage's section (forge.workers.RewardWorker, forge/rewards/teacher.py read it).

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
    teacher: str = ""
    """On-policy distillation: a local HF causal LM directory with the policy's tokenizer; its log-probs of the
    sampled tokens give each one the reward log p_teacher - log p_student (docs/distillation.md); '' = off. Run it
    with update.adaptive.enabled=false: as the reverse KL falls, the grad norm per unit of it spikes and the
    controller cuts the LR (docs/distillation.md)."""
    teacher_weight: float = ranged(1.0, ">= 0")
    """teacher: advantage = verifier advantage + teacher_weight * per-token distillation advantage (with
    reward.verifiers empty: pure distillation)."""
    teacher_discount: float = ranged(0.0, "in [0, 1]", "(0 = token-local)")
    """teacher: 0 = each token's own reward (token-local); gamma in (0, 1] = the discounted return over the
    completion's later sampled tokens."""
    teacher_topk: int = ranged(0, ">= 0", "(0 = off)")
    """teacher: k > 0 = instead of rewarding the sampled token only, the update minimises the reverse KL between the
    student's and the teacher's next-token distributions at every sampled position, over the teacher's k most likely
    tokens and one bucket for the rest (GKD-style; weight reward.teacher_weight). It names the digit the student
    should have sampled, where the sampled-token reward only says its own was unlikely. Token-local: needs
    reward.teacher_discount=0."""
    teacher_divergence: Literal["reverse", "forward"] = "reverse"
    """teacher_topk: which KL over the k + 1 buckets. reverse = KL(student || teacher), mode-seeking, as the sampled-token
    reward; forward = KL(teacher || student), the teacher's cross-entropy on the student's own samples (GKD's
    "supervised KD" on-policy): its gradient stays strong where the student is confidently wrong, where the reverse
    KL's fades with the student's probability of the teacher's token."""

    def check(self, prefix: str) -> None:
        w, n = self.weights, len(self.verifiers)
        why = f"has {len(w)} values for {n} verifiers: give one per verifier (or none)"
        require(not w or len(w) == n, f"{prefix}weights", why)
        why = "needs at least one verifier (or reward.teacher set: pure distillation)"
        require(bool(self.verifiers) or bool(self.teacher), f"{prefix}verifiers", why)
        why = "is empty, but reward.aggregate=ensemble combines verifiers: name them (or use aggregate=weighted)"
        require(bool(self.verifiers) or self.aggregate != "ensemble", f"{prefix}verifiers", why)
        why = "is set, but the top-k divergence is token-local: set reward.teacher_discount=0 (or teacher_topk=0)"
        require(not self.teacher_topk or self.teacher_discount == 0, f"{prefix}teacher_topk", why)
