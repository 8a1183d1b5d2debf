"""The hf rollout's token draw (`sample_tokens`): a block by its mass, then a token inside it. Its frequencies are
those of the distribution (a chi-square test over 200k draws, vocabularies that do and do not fill the last block),
tokens of zero probability (cut by top-p) are never drawn, and seeded draws repeat. That the rollout records the
log-probs of the distribution it sampled from is tested in tests/test_memory_bounded.py.
"""

from __future__ import annotations

import pytest
import torch

from forge.rollout.hf import sample_tokens

torch.set_num_threads(1)

# chi-square critical values at p = 1e-4 (from scipy.stats.chi2.isf(1e-4, dof)): a correct sampler fails 1 in 10^4
CHI2_CRITICAL = {299: 398.6, 255: 347.7}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("vocab,block", [(300, 64), (256, 16)])
def test_draws_follow_the_distribution(vocab, block):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=gen) * 2.0
    probs = torch.softmax(logits, -1)
    rows = 200_000
    torch.manual_seed(1)
    drawn = sample_tokens(probs.expand(rows, vocab).contiguous() * 3.0, block=block).squeeze(1)  # any scale
    counts = torch.bincount(drawn, minlength=vocab).double()
    assert counts.shape == (vocab,)  # nothing outside the vocabulary (the padded tail has no mass)
    assert _chi_square(counts, probs.double()) < CHI2_CRITICAL[vocab - 1]
    # and a wrong distribution is rejected by the same test: the statistic has power at this sample size
    assert _chi_square(counts, torch.softmax(logits * 1.05, -1).double()) > CHI2_CRITICAL[vocab - 1]


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.zeros(5000, 1000)
    probs[:, [3, 500, 999]] = torch.tensor([0.2, 0.3, 0.5])
    torch.manual_seed(2)
    drawn = sample_tokens(probs, block=256).squeeze(1)
    assert set(drawn.unique().tolist()) == {3, 500, 999}
    share = torch.bincount(drawn, minlength=1000)[[3, 500, 999]].double() / 5000
    torch.testing.assert_close(share, torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64), atol=0.03, rtol=0)


def test_seeded_draws_repeat():
    probs = torch.softmax(torch.randn(8, 700), -1)
    torch.manual_seed(5)
    first = sample_tokens(probs)
    torch.manual_seed(5)
    assert torch.equal(first, sample_tokens(probs))
