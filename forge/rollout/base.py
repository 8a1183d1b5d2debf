"""The rollout seam: anything that turns prompts into a `Rollouts` record for a given policy version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from forge.records import Rollouts


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # completions per prompt (G)


class RolloutBackend(Protocol):
    policy_version: int

    def generate(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        """Sample params.n completions per prompt; rows are grouped by prompt (row i -> prompt i // n)."""
        ...

    def sync_weights(self, model, version: int) -> float:
        """Make the backend sample from `model`'s current weights, labelled `version`; returns the seconds it took."""
        ...

    def close(self) -> None:
        """Release what the backend started (engine processes); safe to call twice."""
        ...
