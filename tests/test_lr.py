"""Tests for forge.lr: warmup + schedules (values worked out by hand) and the AdaptiveLR controller."""

from __future__ import annotations

import json
import math

import pytest

from forge.config import UpdateConfig
from forge.lr import AdaptiveConfig, AdaptiveLR, scheduled_lr


def lrs(cfg: UpdateConfig, total: int, steps: range | None = None) -> list[float]:
    return [scheduled_lr(cfg, s, total) for s in (steps or range(total))]


# ---------------------------------------------------------------- scheduled_lr


def test_warmup_then_constant():
    # warmup 4: lr * (step+1)/4 -> 0.25, 0.5, 0.75, 1.0; then the peak for every later step.
    cfg = UpdateConfig(lr=1.0, warmup_steps=4, schedule="constant")
    assert lrs(cfg, 7) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])


def test_constant_without_warmup_is_peak():
    cfg = UpdateConfig(lr=3e-4, warmup_steps=0, schedule="constant")
    assert lrs(cfg, 3) == [3e-4] * 3


def test_warmup_then_linear_to_floor():
    # warmup 2 -> 0.5, 1.0. Decay spans steps 2..6: span = 7 - 2 - 1 = 4, floor = 1.0 * 0.2.
    # step 2: p=0    -> 1.0
    # step 3: p=0.25 -> 0.2 + 0.8 * 0.75 = 0.8
    # step 4: p=0.5  -> 0.2 + 0.8 * 0.5  = 0.6
    # step 5: p=0.75 -> 0.2 + 0.8 * 0.25 = 0.4
    # step 6: p=1    -> 0.2 (the last step reaches the floor)
    cfg = UpdateConfig(lr=1.0, warmup_steps=2, schedule="linear", min_lr_ratio=0.2)
    assert lrs(cfg, 7) == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_linear_clamps_past_the_end():
    # Progress is capped at 1, so steps beyond total_steps (e.g. a resumed run with more steps) stay at the floor.
    cfg = UpdateConfig(lr=1.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.2)
    assert scheduled_lr(cfg, 10, 5) == pytest.approx(0.2)


def test_cosine_without_warmup():
    # span = 5 - 0 - 1 = 4, floor = 0; lr = 2.0 * 0.5 * (1 + cos(pi * p)):
    # p=0 -> 2.0; p=0.25 -> 1 + cos(pi/4) = 1.70711; p=0.5 -> 1.0; p=0.75 -> 1 - 0.70711 = 0.29289; p=1 -> 0.0
    cfg = UpdateConfig(lr=2.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0)
    assert lrs(cfg, 5) == pytest.approx([2.0, 1.70711, 1.0, 0.29289, 0.0], abs=1e-5)


def test_warmup_then_cosine_with_floor():
    # warmup 2 -> 0.5, 1.0. span = 6 - 2 - 1 = 3, floor = 0.1; lr = 0.1 + 0.9 * 0.5 * (1 + cos(pi * p)):
    # step 2: p=0   -> 1.0
    # step 3: p=1/3 -> cos = 0.5  -> 0.1 + 0.9 * 0.75 = 0.775
    # step 4: p=2/3 -> cos = -0.5 -> 0.1 + 0.9 * 0.25 = 0.325
    # step 5: p=1   -> 0.1
    cfg = UpdateConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert lrs(cfg, 6) == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.325, 0.1])


def test_single_decay_step_does_not_divide_by_zero():
    # total = warmup + 1: span = max(1, 0) = 1, the one post-warmup step is at p=0 -> peak.
    cfg = UpdateConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0)
    assert lrs(cfg, 3) == pytest.approx([0.5, 1.0, 1.0])


# ---------------------------------------------------------------- AdaptiveLR: grad_norm


def test_grad_norm_first_step_holds():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    assert a.observe(0.0, 100.0) == 1.0 and a.ema == 100.0 and a.cuts == 0


def test_grad_norm_spike_cuts_then_recovers_slowly_to_exactly_one():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0, cut=0.5, recover=1.1))
    # ema = 1; level = 1 / (2 * 1) = 0.5 is not < 0.5, so the scale holds.
    assert [a.observe(0.0, g) for g in (1.0, 1.0)] == [1.0, 1.0]
    # spike: level = 5 / (2 * 1) = 2.5 > 1 -> scale 0.5; ema becomes 0.9 * 1 + 0.1 * 5 = 1.4.
    assert a.observe(0.0, 5.0) == 0.5 and a.cuts == 1
    assert a.ema == pytest.approx(1.4)
    # calm steps (level = 0.5 / (2 * ema) < 0.25) recover x1.1 each: 0.5 * 1.1**k, below 1 for k <= 7
    # (0.5 * 1.1**7 = 0.974), capped at exactly 1.0 from k = 8 (0.5 * 1.1**8 = 1.07).
    scales = [a.observe(0.0, 0.5) for _ in range(12)]
    assert scales[:7] == pytest.approx([0.5 * 1.1**k for k in range(1, 8)])
    assert all(s < 1.0 for s in scales[:7])
    assert scales[7:] == [1.0] * 5
    assert a.cuts == 1


def test_grad_norm_zero_gradient_steps_are_not_observations():
    """GRPO batches whose groups all have equal rewards give a zero gradient. Measured on the speed task (4 prompts
    x 8): step 1 was such a batch, the average started at 0, and the controller cut the LR to its 1% floor by step 9."""
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    norms = [0.0, 2.1, 2.0, 0.0, 2.4, 2.9, 2.2, 2.5, 2.9, 0.0, 1.9, 2.5]  # that run's first 12 pre-clip norms
    assert [a.observe(0.0, g) for g in norms] == [1.0] * len(norms)
    assert a.cuts == 0 and a.ema == pytest.approx(2.24, abs=0.05)
    assert a.observe(0.0, 10.0) == 0.5  # a real spike still cuts


# One healthy run's (pre-clip grad norm, mean |advantage|) per step: bench/vs_trl.py, demo task, seed 1 (4 prompts x 8
# samples; 3 steps had no signal). The rule before the two-in-a-row one (norm per unit of mean |advantage|, a cut on
# any single observation above target) cut the LR 4 times here, to 0.08 of the schedule's by step 25.
HEALTHY_DEMO_SEED1 = [
    (1.77, 0.357), (1.52, 0.234), (1.9, 0.202), (1.31, 0.202), (2.64, 0.357), (2.92, 0.381), (3.12, 0.357),
    (2.88, 0.436), (0.0, 0.0), (1.65, 0.226), (3.33, 0.436), (5.06, 0.381), (1.81, 0.202), (4.41, 0.429),
    (4.56, 0.663), (3.2, 0.46), (2.87, 0.309), (3.66, 0.202), (2.81, 0.202), (4.3, 0.202), (0.0, 0.0), (3.34, 0.234),
    (4.14, 0.226), (3.91, 0.429), (3.89, 0.155), (0.0, 0.0), (3.48, 0.388), (2.58, 0.155), (1.59, 0.155),
    (3.62, 0.388), (3.55, 0.155), (1.47, 0.202),
]  # fmt: skip


def test_grad_norm_does_not_cut_a_healthy_run():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    assert [a.observe(0.0, g, m) for g, m in HEALTHY_DEMO_SEED1] == [1.0] * len(HEALTHY_DEMO_SEED1)
    assert a.cuts == 0
    # the old rule on the same steps, written out: the controller's test is not vacuous on this series
    scale, ema, cuts = 1.0, None, 0
    for g, m in HEALTHY_DEMO_SEED1:
        if g == 0.0:
            continue
        x = g / m
        if ema is not None and x / (2.0 * ema) > 1.0:
            scale, cuts = scale * 0.5, cuts + 1
        elif ema is not None and x / (2.0 * ema) < 0.5:
            scale = min(1.0, scale * 1.1)
        ema = x if ema is None else 0.9 * ema + 0.1 * x
    assert cuts == 4 and scale < 0.15


def test_grad_norm_cuts_a_rise_that_holds_and_a_severe_spike_at_once():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0, cut=0.5))
    for _ in range(5):
        a.observe(0.0, 1.0)
    assert a.observe(0.0, 2.5) == 1.0 and a.over == 1  # once above target: noise, not yet a cut
    assert a.observe(0.0, 3.0) == 0.5 and a.over == 0  # twice in a row: the rise holds, cut
    b = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0, cut=0.5))
    for _ in range(5):
        b.observe(0.0, 1.0)
    assert b.observe(0.0, 4.5) == 0.5 and b.cuts == 1  # above target^2 = 4x the average: at once


def test_a_checkpoint_from_before_the_two_in_a_row_rule_loads():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    a.load_state_dict({"cfg": {}, "scale": 0.5, "ema": 1.4, "cuts": 1})
    assert (a.scale, a.ema, a.cuts, a.over) == (0.5, 1.4, 1, 0)


def test_grad_norm_hold_zone():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    a.observe(0.0, 1.0)
    a.observe(0.0, 5.0)  # cut to 0.5, ema 1.4
    # level = 2.0 / (2 * 1.4) = 0.714: between 0.5 and 1 -> neither cut nor recover.
    assert a.observe(0.0, 2.0) == 0.5


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_grad_norm_non_finite_cuts_and_keeps_ema(bad):
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    a.observe(0.0, 1.0)
    assert a.observe(0.0, bad) == 0.5 and a.ema == 1.0


def test_scale_floor():
    a = AdaptiveLR(AdaptiveConfig(signal="kl", target=0.1, cut=0.5, min_scale=0.01))
    for _ in range(10):  # 0.5**10 = 0.001 would be below the floor
        a.observe(1.0, 0.0)
    assert a.scale == 0.01 and a.cuts == 10


# ---------------------------------------------------------------- AdaptiveLR: kl


def test_kl_mode_cuts_above_target_and_recovers_below_half():
    a = AdaptiveLR(AdaptiveConfig(signal="kl", target=0.1, cut=0.5, recover=1.1))
    assert a.observe(0.2, 1e9) == 0.5  # 0.2 / 0.1 = 2 > 1: cut (grad norm ignored in kl mode)
    assert a.observe(0.08, 0.0) == 0.5  # 0.8: hold
    assert a.observe(0.1, 0.0) == 0.5  # exactly at target (level 1.0): hold, not cut
    assert a.observe(0.01, 0.0) == pytest.approx(0.55)  # 0.1 < 0.5: recover x1.1
    assert a.cuts == 1 and a.ema is None


def test_from_config():
    cfg = UpdateConfig(adaptive=AdaptiveConfig(signal="kl", target=0.05, cut=0.3, recover=1.2))
    a = AdaptiveLR(cfg.adaptive)
    assert (a.cfg.signal, a.cfg.target, a.cfg.cut, a.cfg.recover, a.scale) == ("kl", 0.05, 0.3, 1.2, 1.0)


# ---------------------------------------------------------------- state


def test_state_dict_round_trip_continues_identically():
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0))
    for g in (1.0, 1.2, 6.0, 0.4):
        a.observe(0.0, g)
    state = json.loads(json.dumps(a.state_dict()))  # plain values only (it goes into trainer_state.json)
    b = AdaptiveLR()
    b.load_state_dict(state)
    assert b == a
    tail = (0.3, 9.0, math.inf, 0.2, 0.2)
    assert [a.observe(0.0, g) for g in tail] == [b.observe(0.0, g) for g in tail]
    assert (a.ema, a.cuts) == (b.ema, b.cuts)


def test_load_state_dict_keeps_this_runs_settings():
    """A resume may change the controller's settings: the saved running state is restored, not the saved settings."""
    a = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=2.0, cut=0.5))
    for g in (1.0, 1.0, 5.0):
        a.observe(0.0, g)
    b = AdaptiveLR(AdaptiveConfig(signal="grad_norm", target=3.0, cut=0.25, recover=1.2))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.scale, b.ema, b.cuts) == (a.scale, a.ema, a.cuts) == (0.5, a.ema, 1)
    assert (b.cfg.target, b.cfg.cut, b.cfg.recover) == (3.0, 0.25, 1.2)
