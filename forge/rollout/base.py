"""The rollout seam: anything that turns prompts into a `Rollouts` record for a given policy version."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from forge.records import Episodes, Rollouts, SamplingParams

__all__ = ["SamplingParams", "rollout_seed", "RolloutBackend"]


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step`'s rollout, derived from the run seed: a retried, resumed or recovered step
    samples what the uninterrupted one did, with no RNG state to carry. Backends offset it per row or per chunk
    (vLLM: `seed + i` for row i), so it leaves room below 2**31.

    >>> rollout_seed(0, 1) == rollout_seed(0, 1) != rollout_seed(0, 2)
    True
    """
    return int(np.random.SeedSequence([seed, step, ROLLOUT_STREAM]).generate_state(1)[0]) & 0x3FFFFFFF


ROLLOUT_STREAM = 1 << 20  # keeps the rollout seeds apart from the update's (seed, step, rank) ones


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


def cat_padded(tensors: list[torch.Tensor], value, left: bool) -> torch.Tensor:
    """Stack [n_i, T_i] tensors into [sum n_i, max T_i], padding with `value` on the left or the right."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
        padded.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(padded, dim=0)


def concat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """One Rollouts record from several replicas' records of consecutive prompt groups (same G and version)."""
    first = parts[0]
    assert all(p.group_size == first.group_size and p.policy_version == first.policy_version for p in parts)
    return Rollouts(
        prompt_ids=cat_padded([p.prompt_ids for p in parts], pad_id, left=True),
        prompt_mask=cat_padded([p.prompt_mask for p in parts], 0, left=True),
        completion_ids=cat_padded([p.completion_ids for p in parts], pad_id, left=False),
        completion_mask=cat_padded([p.completion_mask for p in parts], 0, left=False),
        sampling_logprobs=cat_padded([p.sampling_logprobs for p in parts], 0.0, left=False),
        texts=[t for p in parts for t in p.texts],
        finish_reasons=[f for p in parts for f in p.finish_reasons],
        group_size=first.group_size,
        policy_version=first.policy_version,
        prompts=[t for p in parts for t in p.prompts],
        seconds=max(p.seconds for p in parts),  # the replicas sample side by side
        loss_mask=_concat_loss_masks(parts),
        episodes=Episodes.concat([p.episodes for p in parts]),
    )


def _concat_loss_masks(parts: list[Rollouts]) -> torch.Tensor | None:
    """The parts' loss masks side by side; None (= the completion mask) when every part is single-turn, so the
    merged record stays single-turn for the trainer too (`Rollouts.single_turn`)."""
    if all(p.single_turn for p in parts):
        return None
    return cat_padded([p.loss_mask for p in parts], 0, left=False)
