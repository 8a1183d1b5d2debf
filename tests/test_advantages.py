"""Tests for forge.advantages: the three group estimators on hand-computed groups, and frac_zero_std."""

from __future__ import annotations

import pytest
import torch

from forge.advantages import frac_zero_std, group_advantages

# Two groups of G = 3, rows grouped by prompt: [0, 1, 2] and [1, 1, 4].
#   group 1: mean 1, deviations [-1, 0, 1], unbiased std sqrt((1 + 0 + 1) / 2) = 1
#   group 2: mean 2, deviations [-1, -1, 2], unbiased std sqrt((1 + 1 + 4) / 2) = sqrt(3) = 1.7320508
REWARDS = torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0, 4.0])
SQRT3 = 3**0.5
EXPECTED = {
    # (r - mean) / (std + 1e-4): [-1, 0, 1] / 1.0001 and [-1, -1, 2] / 1.7321508
    "zscore": [-1 / 1.0001, 0.0, 1 / 1.0001, -1 / (SQRT3 + 1e-4), -1 / (SQRT3 + 1e-4), 2 / (SQRT3 + 1e-4)],
    # r - mean
    "mean": [-1.0, 0.0, 1.0, -1.0, -1.0, 2.0],
    # r - mean of the others: 0 - (1+2)/2 = -1.5, 1 - (0+2)/2 = 0, 2 - (0+1)/2 = 1.5;
    #                         1 - (1+4)/2 = -1.5 (twice), 4 - (1+1)/2 = 3
    "loo": [-1.5, 0.0, 1.5, -1.5, -1.5, 3.0],
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_estimators_on_hand_computed_groups(kind):
    adv = group_advantages(REWARDS, 3, kind)
    assert adv.shape == (6,)
    assert adv.tolist() == pytest.approx(EXPECTED[kind], abs=1e-6)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_advantages_sum_to_zero_per_group(kind):
    adv = group_advantages(REWARDS, 3, kind).view(2, 3)
    assert adv.sum(1).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_all_equal_group_gives_zero_advantages(kind):
    # group 1 all equal (std 0: z-score is 0 / 1e-4 = 0, not NaN); group 2 [0, 1] stays informative
    adv = group_advantages(torch.tensor([2.0, 2.0, 0.0, 1.0]), 2, kind)
    assert torch.isfinite(adv).all()
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2] < 0 < adv[3]


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(REWARDS, 3, "median")


def test_frac_zero_std():
    # four groups of 3: [0, 1, 2] varies, [2, 2, 2] equal, [0, 0, 0] equal, [1, 0, 1] varies -> 2 / 4
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    assert frac_zero_std(rewards, 3) == pytest.approx(0.5)
    assert frac_zero_std(REWARDS, 3) == 0.0
    assert frac_zero_std(torch.ones(4), 2) == 1.0
