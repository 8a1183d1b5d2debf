"""Group-relative advantage estimators (see shared/reference/grpo.md).

Rewards arrive as a flat [N] tensor with N = B*G, rows grouped by prompt (row i -> prompt i // G).
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
