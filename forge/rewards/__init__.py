"""The reward stage: verifiers (`verifiers`), answer extraction (`math`), lookup (`registry`), scoring (`score`).

The names below are imported on first use (PEP 562): the config sections beside their components
(`code_exec.CodeExecConfig`, `ensemble.RewardEnsembleConfig`) are imported by `forge.config` without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
_LAZY = {
    "resolve_verifier": "registry",
    "resolve_verifiers": "registry",
    "RewardResult": "score",
    "per_verifier_means": "score",
    "score_completions": "score",
    "BUILTIN": "verifiers",
    "Verifier": "verifiers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"forge.rewards.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'forge.rewards' has no attribute {name!r}")
