"""The reward stage: verifiers (`verifiers`), answer extraction (`math`), lookup (`registry`), scoring (`score`)."""

from forge.rewards.registry import resolve_verifier, resolve_verifiers
from forge.rewards.score import RewardResult, per_verifier_means, score_completions
from forge.rewards.verifiers import BUILTIN, Verifier

__all__ = [
    "BUILTIN",
    "RewardResult",
    "Verifier",
    "per_verifier_means",
    "resolve_verifier",
    "resolve_verifiers",
    "score_completions",
]
