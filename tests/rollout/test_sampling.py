"""The hf rollout's own sampler (forge/rollout/hf.py `sample_categorical`): exact draws from the distribution."""

from __future__ import annotations

import torch

from forge.rollout.hf import sample_categorical


def test_draws_follow_the_distribution_and_never_a_zero_probability_entry():
    torch.manual_seed(0)
    V = 1000  # not a multiple of the block: the padded tail must never be drawn
    p = torch.rand(V) ** 4  # skewed, with a long tail of small entries
    p[torch.randperm(V)[:300]] = 0.0  # zero-probability entries, some whole blocks of 16 among them
    p[16:32] = 0.0
    rows = 4000
    draws = torch.cat([sample_categorical(p.expand(rows, V).contiguous(), block=16) for _ in range(10)]).flatten()
    assert draws.min() >= 0 and draws.max() < V
    assert not (p[draws] == 0).any()
    freq = torch.bincount(draws, minlength=V).double() / draws.numel()
    expected = p.double() / p.double().sum()
    sigma = (expected * (1 - expected) / draws.numel()).sqrt()
    # 5 standard deviations, plus three draws of slack where the expected count is far below one
    assert ((freq - expected).abs() <= 5 * sigma + 3 / draws.numel()).all()


def test_seeded_draws_repeat_and_rows_are_independent():
    p = torch.full((64, 50), 1.0)
    torch.manual_seed(3)
    a = sample_categorical(p)
    torch.manual_seed(3)
    assert torch.equal(sample_categorical(p), a)
    assert a.shape == (64, 1) and len(set(a.flatten().tolist())) > 20  # 64 uniform draws over 50 entries
