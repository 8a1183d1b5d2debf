"""`distill`: on-policy distillation's section (forge/rewards/teacher.py loads the teacher; forge.workers.RewardWorker
adds its per-token advantage, or hands the update its top k, whose KL the loss adds: forge/losses.py).

Kept apart from forge/rewards/teacher.py, which imports torch: `forge.config` stays importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forge.config_base import ranged, require


@dataclass(kw_only=True)
class DistillConfig:
    teacher: str = ""
    """On-policy distillation: a local HF causal LM directory with the policy's tokenizer; its log-probs of the
    sampled tokens give each one the reward log p_teacher - log p_student (docs/distillation.md); '' = off. Run it
    with update.adaptive.enabled=false: as the reverse KL falls, the grad norm per unit of it spikes and the
    controller cuts the LR (docs/distillation.md)."""
    weight: float = ranged(1.0, ">= 0")
    """advantage = verifier advantage + weight * per-token distillation advantage (with reward.verifiers empty: pure
    distillation); with topk, the weight of the top-k KL in the loss."""
    discount: float = ranged(0.0, "in [0, 1]", "(0 = token-local)")
    """0 = each token's own reward (token-local); gamma in (0, 1] = the discounted return over the completion's later
    sampled tokens."""
    topk: int = ranged(0, ">= 0", "(0 = off)")
    """k > 0 = instead of rewarding the sampled token only, the update minimises the reverse KL between the student's
    and the teacher's next-token distributions at every sampled position, over the teacher's k most likely tokens and
    one bucket for the rest (GKD-style; weight distill.weight). It names the digit the student should have sampled,
    where the sampled-token reward only says its own was unlikely. Token-local: needs distill.discount=0."""
    divergence: Literal["reverse", "forward"] = "reverse"
    """topk: which KL over the k + 1 buckets. reverse = KL(student || teacher), mode-seeking, as the sampled-token
    reward; forward = KL(teacher || student), the teacher's cross-entropy on the student's own samples (GKD's
    "supervised KD" on-policy): its gradient stays strong where the student is confidently wrong, where the reverse
    KL's fades with the student's probability of the teacher's token."""

    def check(self, prefix: str) -> None:
        why = f"is set, but the top-k divergence is token-local: set {prefix}discount=0 (or {prefix}topk=0)"
        require(not self.topk or self.discount == 0, f"{prefix}topk", why)
