"""Group-relative advantage estimators (see shared/reference/grpo.md).

Rewards arrive as a flat [N] tensor with N = B*G, rows grouped by prompt (row i -> prompt i // G).

Advantages reach the update as [N] (one per completion, broadcast over its tokens) or [N, T] (one per completion
token, aligned with `Rollouts.completion_ids`: on-policy distillation, forge/rewards/teacher.py). `advantage_rows`
cuts a micro-batch out of either, `advantage_mass` and `per_completion` are the figures that read them.
"""

from __future__ import annotations

import torch

EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, kind: str) -> torch.Tensor:
    """[N] rewards -> [N] advantages.

    zscore (GRPO): (r - mean_g) / (std_g + 1e-4); mean (Dr. GRPO): r - mean_g; loo (RLOO): r - mean of the others.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "mean").tolist()
    [0.75, -0.25, -0.25, -0.25]
    >>> [round(x, 4) for x in group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "loo").tolist()]
    [1.0, -0.3333, -0.3333, -0.3333]
    """
    r = rewards.view(-1, group_size).float()  # [B, G]
    mean = r.mean(dim=1, keepdim=True)
    if kind == "zscore":
        adv = (r - mean) / (r.std(dim=1, keepdim=True) + EPS)  # unbiased std, as in the GRPO paper
    elif kind == "mean":
        adv = r - mean
    elif kind == "loo":
        adv = (r - mean) * group_size / (group_size - 1)  # r - (sum - r)/(G-1), rearranged
    else:
        raise ValueError(f"unknown advantage estimator {kind!r}")
    return adv.reshape(-1)


def frac_zero_std(rewards: torch.Tensor, group_size: int) -> float:
    """Share of groups whose rewards are all equal (they carry no learning signal)."""
    r = rewards.view(-1, group_size)
    return float((r.max(dim=1).values == r.min(dim=1).values).float().mean())


def advantage_rows(advantages: torch.Tensor, rows: slice, width: int) -> torch.Tensor:
    """Rows `rows` of [N] or [N, T] advantages; a per-token tensor is cut to the micro-batch's `width` tokens.

    >>> advantage_rows(torch.arange(6.0).view(2, 3), slice(1, 2), 2).tolist()
    [[3.0, 4.0]]
    """
    return advantages[rows] if advantages.dim() == 1 else advantages[rows, :width]


def advantage_mass(advantages: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """Mean |advantage|: over completions for [N], over the tokens the loss counts ([N, T] mask) for [N, T].

    >>> advantage_mass(torch.tensor([[2.0, -4.0], [1.0, 9.0]]), torch.tensor([[1, 1], [1, 0]]))
    2.3333332538604736
    """
    if advantages.dim() == 1:
        return float(advantages.abs().mean())
    m = loss_mask.bool()
    return float(advantages.abs()[m].mean()) if m.any() else 0.0


def per_completion(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[N] advantages as they are; [N, T] ones as each completion's mean over its loss tokens (0 when it has none).

    >>> per_completion(torch.tensor([[2.0, -4.0], [1.0, 9.0]]), torch.tensor([[1, 1], [1, 0]])).tolist()
    [-1.0, 1.0]
    """
    if advantages.dim() == 1:
        return advantages
    m = loss_mask.to(advantages.dtype)
    return (advantages * m).sum(1) / m.sum(1).clamp(min=1)
