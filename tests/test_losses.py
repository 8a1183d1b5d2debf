"""Tests for forge.losses: every loss type on tiny hand-made tensors, with the expected numbers worked out below.

Shared layout unless a test says otherwise: n = 2 sequences, T = 3 tokens, the second sequence has one padded
token (mask [[1, 1, 1], [1, 1, 0]]), so the step holds 5 completion tokens. `old = 0` and `logp = log r` make
the per-token ratio r exactly the number written in the test.
"""

from __future__ import annotations

import math

import pytest
import torch

from forge.config import AlgoConfig
from forge.losses import StepTotals
from forge.recipes.grpo import grpo_loss

torch.set_num_threads(1)

LOSSES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # [n=2, T=3]
TOTALS = StepTotals(sequences=2, tokens=5, max_len=5)  # max_len != T so Dr. GRPO's horizon is visible


def policy_loss(logp, old, adv, mask, algo, totals, ref_logp=None, **kw):
    """grpo_loss with its settings passed in order (the cases below read better that way)."""
    return grpo_loss(logp, old, adv, mask, algo=algo, totals=totals, ref_logp=ref_logp, **kw)


def leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def log_of(rows: list[list[float]]) -> torch.Tensor:
    return leaf([[math.log(r) for r in row] for row in rows])


def zeros() -> torch.Tensor:
    return torch.zeros(2, 3, dtype=torch.float64)


# ---------------------------------------------------------------- ratio exactly 1


# logp = old, so r = 1 everywhere and nothing is clipped; A = [1, -0.5].
# PPO-style losses: L_t = -A_i, i.e. seq0 tokens -1 (3 of them), seq1 tokens +0.5 (2 real, 1 pad).
#   grpo/gspo (sequence mean): (mean(-1,-1,-1) + mean(0.5,0.5)) / 2 = (-1 + 0.5) / 2 = -0.25
#   dr_grpo (fixed horizon):   (3*(-1) + 2*0.5) / (N * T_max) = -2 / (2*5) = -0.2
#   dapo (token mean):         -2 / 5 = -0.4      (dual clip inactive: min(0.5, 3*0.5) = 0.5)
# cispo: L_t = -sg(min(1, 4)) * A * logp, with logp = [[-1, -2, -0.5], [-1, -1, -3(pad)]]:
#   seq0: -1*(-1), -1*(-2), -1*(-0.5) = 1 + 2 + 0.5 = 3.5;  seq1: 0.5*(-1) + 0.5*(-1) = -1
#   token mean: (3.5 - 1) / 5 = 0.5
# Gradients d loss / d logp (pad token always 0):
#   grpo/gspo: -A_i / (len_i * N): seq0 -1/(3*2) = -1/6, seq1 0.5/(2*2) = 0.125
#   dr_grpo:   -A_i / (N * T_max) = -1/10, 0.5/10 = 0.05
#   dapo, cispo: -A_i / tokens = -1/5 = -0.2, 0.5/5 = 0.1
RATIO_ONE = {
    "grpo": (-0.25, [-1 / 6, 0.125]),
    "dr_grpo": (-0.2, [-0.1, 0.05]),
    "dapo": (-0.4, [-0.2, 0.1]),
    "gspo": (-0.25, [-1 / 6, 0.125]),
    "cispo": (0.5, [-0.2, 0.1]),
}


@pytest.mark.parametrize("loss", LOSSES)
def test_ratio_one_gives_minus_aggregated_advantage(loss):
    logp = leaf([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    adv = torch.tensor([1.0, -0.5])
    out = policy_loss(logp, logp.detach(), adv, MASK, AlgoConfig(loss=loss), TOTALS)
    value, (g0, g1) = RATIO_ONE[loss]
    assert out.loss.item() == pytest.approx(value, abs=1e-12)
    out.loss.backward()
    expected = torch.tensor([[g0, g0, g0], [g1, g1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert not out.clipped_low.any() and not out.clipped_high.any()
    assert torch.equal(out.kl_old, torch.zeros_like(out.kl_old))  # approx KL to logp_old is exactly 0 at r = 1


# ---------------------------------------------------------------- PPO clipping (grpo, dr_grpo, dapo)


# eps_low = eps_high = 0.2 (clip range [0.8, 1.2]), A = [1, -1], ratios [[1.5, 0.5, 1.0], [0.5, 1.5, pad]].
#   seq0 (A = +1): L = -min(r, clip(r)):
#     r=1.5 -> -min(1.5, 1.2) = -1.2  clipped (high): grad 0
#     r=0.5 -> -min(0.5, 0.8) = -0.5  not clipped:    dL/dlogp = -r*A = -0.5
#     r=1.0 -> -1.0                                   dL/dlogp = -1.0
#   seq1 (A = -1): L = -min(-r, -clip(r)) = max(r, clip(r)):
#     r=0.5 -> max(0.5, 0.8) = 0.8    clipped (low):  grad 0
#     r=1.5 -> max(1.5, 1.2) = 1.5    not clipped:    dL/dlogp = -r*A = 1.5
#   per-token sums: seq0 -2.7, seq1 2.3, all -0.4
#   grpo:    (-2.7/3 + 2.3/2) / 2 = (-0.9 + 1.15) / 2 = 0.125;  grads /(len_i*N): seq0 /6, seq1 /4
#   dr_grpo: -0.4 / (2*5) = -0.04;                             grads /10
#   dapo:    -0.4 / 5 = -0.08 (no A<0 token exceeds 3|A|);    grads /5
# Without clipping grpo would be (-(1.5+0.5+1)/3 + (0.5+1.5)/2) / 2 = (-1 + 1) / 2 = 0.
CLIP = {"grpo": (0.125, (6.0, 4.0)), "dr_grpo": (-0.04, (10.0, 10.0)), "dapo": (-0.08, (5.0, 5.0))}


@pytest.mark.parametrize("loss", sorted(CLIP))
def test_ppo_clip_changes_value_and_zeroes_gradient_where_clipped(loss):
    logp = log_of([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(logp, zeros(), adv, MASK, AlgoConfig(loss=loss, eps_low=0.2, eps_high=0.2), TOTALS)
    value, (d0, d1) = CLIP[loss]
    assert out.loss.item() == pytest.approx(value, abs=1e-9)
    out.loss.backward()
    expected = torch.tensor([[0.0, -0.5 / d0, -1.0 / d0], [0.0, 1.5 / d1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert out.clipped_high.tolist() == [[True, False, False], [False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, False], [True, False, False]]


# ---------------------------------------------------------------- DAPO dual clip


# DAPO, eps_low 0.2, eps_high 0.28 (clip-higher), dual clip c = 3. mask [[1, 1, 0], [1, 1, 1]] (5 tokens),
# A = [-1, +1], ratios [[5, 1, pad], [5, 1, 1]].
#   seq0 (A = -1): r=5 -> PPO term max(5, 1.2) = 5, dual clip min(5, -c*A = 3) = 3: grad 0
#                  r=1 -> 1,  dL/dlogp = -r*A = 1
#   seq1 (A = +1): r=5 -> -min(5, 1.28) = -1.28 (clip-higher bound): grad 0
#                  r=1 -> -1, -1: dL/dlogp = -1 each
#   dapo: (3 + 1 - 1.28 - 1 - 1) / 5 = 0.72 / 5 = 0.144;  grads [[0, 0.2, 0], [0, -0.2, -0.2]]
#   grpo on the same tokens has no dual clip: seq0 mean (5 + 1)/2 = 3, seq1 mean (-1.28 - 1 - 1)/3 = -3.28/3,
#   loss (3 - 3.28/3) / 2 = 0.95333; its gradient at seq0's r=5 token is -r*A/(len*N) = 5/(2*2) = 1.25
def test_dapo_dual_clip_caps_negative_advantage_with_big_ratio():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([-1.0, 1.0])
    cfg = AlgoConfig(loss="dapo", eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    logp = log_of([[5.0, 1.0, 1.0], [5.0, 1.0, 1.0]])
    out = policy_loss(logp, zeros(), adv, mask, cfg, TOTALS)
    assert out.loss.item() == pytest.approx(0.144, abs=1e-9)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.2, 0.0], [0.0, -0.2, -0.2]], dtype=torch.float64))

    logp2 = log_of([[5.0, 1.0, 1.0], [5.0, 1.0, 1.0]])
    grpo = policy_loss(logp2, zeros(), adv, mask, AlgoConfig(loss="grpo", eps_low=0.2, eps_high=0.28), TOTALS)
    assert grpo.loss.item() == pytest.approx((3 - 3.28 / 3) / 2, abs=1e-9)
    grpo.loss.backward()
    assert logp2.grad[0, 0] == pytest.approx(-5.0 * -1.0 / (2 * 2))  # unclipped there: -r*A/(len*N) = 1.25


# ---------------------------------------------------------------- GSPO sequence-level ratio


# GSPO, clip [0.8, 1.2], A = [1, 2]. Log-ratios seq0 [0.3, -0.1, 0.1] -> mean 0.1 -> s0 = e^0.1 = 1.1051709
# (inside the clip range although token 0 alone, e^0.3 = 1.35, is not); seq1 [0.5, 0.3, pad 5.0 ignored]
# -> mean 0.4 -> s1 = e^0.4 = 1.4918247 > 1.2 with A > 0: clipped to 1.2.
#   seq0: every token L = -s0*A = -1.1051709, mean -1.1051709
#   seq1: every token L = -1.2*2 = -2.4 (clipped, grad 0)
#   loss = (-1.1051709 - 2.4) / 2 = -1.7525855
#   grad on seq0 tokens: d/dlogp_t (-s0*A/N) with ds0/dlogp_t = s0/len: -1.1051709 / (3*2) = -0.1841952
#   approx KL per token (same for every token of a sequence): s - 1 - log s; seq0: 1.1051709 - 1 - 0.1 = 0.0051709
def test_gspo_uses_one_sequence_ratio():
    logp = leaf([[0.3, -0.1, 0.1], [0.5, 0.3, 5.0]])
    adv = torch.tensor([1.0, 2.0])
    out = policy_loss(logp, zeros(), adv, MASK, AlgoConfig(loss="gspo", eps_low=0.2, eps_high=0.2), TOTALS)
    s0, s1 = math.exp(0.1), math.exp(0.4)
    assert out.loss.item() == pytest.approx((-s0 - 2.4) / 2, abs=1e-9)
    assert out.loss.item() == pytest.approx(-1.7525855, abs=1e-6)
    out.loss.backward()
    g = -s0 / 6
    torch.testing.assert_close(logp.grad, torch.tensor([[g, g, g], [0.0, 0.0, 0.0]], dtype=torch.float64))
    kl0, kl1 = s0 - 1 - 0.1, s1 - 1 - 0.4
    torch.testing.assert_close(out.kl_old[:, :2], torch.tensor([[kl0, kl0], [kl1, kl1]], dtype=torch.float64))
    assert out.kl_old[0, 2] == pytest.approx(kl0)  # token 0 alone would have given e^0.3 - 1 - 0.3
    assert out.clipped_high.tolist() == [[False, False, False], [True, True, False]]


# ---------------------------------------------------------------- CISPO capped stop-gradient weight


# CISPO, eps_max = 4, A = [1, -1], logp = [[-1, -2, -0.5], [-1, -0.5, pad]], ratios [[6, 2, 1], [0.5, 5, pad]]
# (old = logp - log r). Weights w = sg(min(r, 4)) = [[4, 2, 1], [0.5, 4]].
#   L_t = -w*A*logp: seq0 -4*(-1) = 4, -2*(-2) = 4, -1*(-0.5) = 0.5 -> 8.5
#                    seq1 +0.5*(-1) = -0.5, +4*(-0.5) = -2     -> -2.5
#   loss = (8.5 - 2.5) / 5 = 1.2
#   grad = -min(r, 4)*A / 5: seq0 [-0.8, -0.4, -0.2], seq1 [0.1, 0.8, 0] -- capped tokens still get gradient
def test_cispo_gradient_is_capped_stop_gradient_weight():
    logp = leaf([[-1.0, -2.0, -0.5], [-1.0, -0.5, -3.0]])
    ratios = torch.tensor([[6.0, 2.0, 1.0], [0.5, 5.0, 1.0]], dtype=torch.float64)
    old = logp.detach() - ratios.log()
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(logp, old, adv, MASK, AlgoConfig(loss="cispo", cispo_eps_max=4.0), TOTALS)
    assert out.loss.item() == pytest.approx(1.2, abs=1e-9)
    out.loss.backward()
    expected = -ratios.clamp(max=4.0) * adv.double().unsqueeze(1) * MASK / 5
    torch.testing.assert_close(logp.grad, expected)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.8, -0.4, -0.2], [0.1, 0.8, 0.0]], dtype=torch.float64))
    assert out.clipped_high.tolist() == [[True, False, False], [False, True, False]]
    assert not out.clipped_low.any()


# ---------------------------------------------------------------- k3 KL to the reference


# beta = 0.1, r = 1 (logp = old), A = [1, -0.5], d = ref - logp = [[0, ln2, -ln2], [ln2, 0, pad 5]].
# k3 = e^d - d - 1: d=0 -> 0; d=ln2 -> 2 - 0.693147 - 1 = 0.306853; d=-ln2 -> 0.5 + 0.693147 - 1 = 0.193147
#   (0.306853 + 0.193147 = 0.5 exactly: the ln2 terms cancel)
#   grpo: seq0 mean(-1 + 0.1*kl) = -1 + 0.1*0.5/3 = -0.98333333
#         seq1 mean(0.5 + 0.1*kl) = 0.5 + 0.1*0.306853/2 = 0.51534264
#         loss = (-0.98333333 + 0.51534264) / 2 = -0.23399534
#   dapo: (-2 + 0.1*(0.5 + 0.306853)) / 5 = (-2 + 0.0806853) / 5 = -0.38386294
#   d KL_t / d logp_t = 1 - e^d, so the KL gradient pulls logp toward ref
K3 = {"grpo": -0.23399534, "dapo": -0.38386294}


@pytest.mark.parametrize("loss", sorted(K3))
def test_k3_kl_value_and_sign(loss):
    logp = leaf([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    d = torch.tensor([[0.0, math.log(2), -math.log(2)], [math.log(2), 0.0, 5.0]], dtype=torch.float64)
    out = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([1.0, -0.5]),
        MASK,
        AlgoConfig(loss=loss, beta=0.1),
        TOTALS,
        ref_logp=logp.detach() + d,
    )
    assert out.loss.item() == pytest.approx(K3[loss], abs=1e-7)
    ln2 = math.log(2)
    expected_kl = [[0.0, 1 - ln2, ln2 - 0.5], [1 - ln2, 0.0]]
    assert out.kl_ref[0].tolist() == pytest.approx(expected_kl[0], abs=1e-12)
    assert out.kl_ref[1, :2].tolist() == pytest.approx(expected_kl[1], abs=1e-12)
    assert (out.kl_ref >= 0).all()


@pytest.mark.parametrize("loss", LOSSES)
def test_k3_kl_is_nonnegative_and_adds_beta_times_aggregated_kl(loss):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    old = logp + 0.1 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    ref = logp + torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    totals = StepTotals(sequences=4, tokens=int(mask.sum()), max_len=6)
    plain = policy_loss(logp, old, adv, mask, AlgoConfig(loss=loss), totals)
    with_kl = policy_loss(logp, old, adv, mask, AlgoConfig(loss=loss, beta=0.5), totals, ref_logp=ref)
    assert (with_kl.kl_ref >= 0).all()
    # the KL term is aggregated like the policy term: for r = 1 the same aggregation of a constant-free tensor
    kl_only = policy_loss(logp, logp, torch.zeros(4), mask, AlgoConfig(loss=loss, beta=0.5), totals, ref_logp=ref)
    assert kl_only.loss.item() >= 0  # A = 0: only beta * KL remains, cispo included (-w*0*logp = 0)
    assert with_kl.loss.item() == pytest.approx(plain.loss.item() + kl_only.loss.item(), abs=1e-12)


def test_beta_without_reference_is_an_error():
    logp = leaf([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    with pytest.raises(AssertionError, match="reference"):
        policy_loss(logp, logp.detach(), torch.ones(2), MASK, AlgoConfig(beta=0.1), TOTALS)


# ---------------------------------------------------------------- micro-batch invariance


def _batch_of_8():
    g = torch.Generator().manual_seed(1)
    T = 6
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 3])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [8, T] right-padded
    logp = -torch.rand(8, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(8, T, generator=g, dtype=torch.float64)  # ratios on both sides of the clip range
    ref = logp + 0.5 * torch.randn(8, T, generator=g, dtype=torch.float64)
    adv = torch.randn(8, generator=g)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("loss", LOSSES)
def test_micro_batch_split_gives_same_loss_and_gradient(loss, beta):
    logp0, old, ref, adv, mask = _batch_of_8()
    totals = StepTotals(sequences=8, tokens=int(mask.sum()), max_len=8)
    cfg = AlgoConfig(loss=loss, beta=beta)
    results = []
    for size in (8, 4, 2):  # 1, 2 and 4 micro-batches
        logp = logp0.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for i in range(0, 8, size):
            sl = slice(i, i + size)
            width = int(mask[sl].sum(1).max())  # trim shared right padding, as the trainer does
            out = policy_loss(
                logp[sl, :width],
                old[sl, :width],
                adv[sl],
                mask[sl, :width],
                cfg,
                totals,
                ref_logp=ref[sl, :width] if beta > 0 else None,
            )
            out.loss.backward()
            total = total + out.loss.detach()
        results.append((float(total), logp.grad.clone()))
    (loss_full, grad_full), *splits = results
    assert grad_full.abs().sum() > 0
    for value, grad in splits:
        assert value == pytest.approx(loss_full, abs=1e-12)
        torch.testing.assert_close(grad, grad_full, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- off-policy correction (TIS)


def test_importance_weights_are_truncated_ratios_to_the_sampler():
    from forge.losses import importance_weights

    # pi_old / mu per token: e^0 = 1, e^{ln 1.5} = 1.5, e^{ln 4} = 4 -> capped at 2; e^{-ln 2} = 0.5 (never floored)
    old = torch.tensor([[0.0, math.log(1.5), math.log(4.0)], [-math.log(2.0), 0.0, 0.0]])
    w = importance_weights(old, torch.zeros(2, 3), cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, 2.0], [0.5, 1.0, 1.0]]))


@pytest.mark.parametrize("loss", LOSSES)
def test_is_weights_scale_each_tokens_policy_term_and_its_gradient(loss):
    """Ratio 1 (see RATIO_ONE): the policy term of token t is -A_i, times w_t. With w = 1 nothing changes; with
    w = 2 on every token loss and gradient double (the weight is a constant: no gradient flows into it)."""
    cfg = AlgoConfig(loss=loss)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    base = log_of([[1, 1, 1], [1, 1, 1]])
    plain = policy_loss(base, base.detach(), adv, MASK, cfg, TOTALS)
    plain.loss.backward()
    for w, factor in ((1.0, 1.0), (2.0, 2.0)):
        logp = log_of([[1, 1, 1], [1, 1, 1]])
        weight = torch.full((2, 3), w, dtype=torch.float64, requires_grad=True)
        out = policy_loss(logp, logp.detach(), adv, MASK, cfg, TOTALS, is_weight=weight)
        out.loss.backward()
        assert float(out.loss.detach()) == pytest.approx(factor * float(plain.loss.detach()))
        assert torch.allclose(logp.grad, factor * base.grad)
        assert weight.grad is None or not weight.grad.any()


def test_is_weights_do_not_reweight_the_kl_term():
    cfg = AlgoConfig(loss="dapo", beta=0.5)
    adv = torch.zeros(2, dtype=torch.float64)  # no policy term: the loss is beta * token-mean KL only
    logp, ref = log_of([[1, 1, 1], [1, 1, 1]]), torch.full((2, 3), -0.3, dtype=torch.float64)
    a = policy_loss(logp, logp.detach(), adv, MASK, cfg, TOTALS, ref)
    b = policy_loss(logp, logp.detach(), adv, MASK, cfg, TOTALS, ref, is_weight=torch.full((2, 3), 2.0))
    assert float(a.loss) == pytest.approx(float(b.loss)) and float(a.loss) > 0
