"""Latent class model for discrete verifiers: necessary-condition checks, missing scores, binning, the aggregator.

The synthetic task mimics arithmetic with rule checks: a correct answer passes every check; a well-formed wrong one
passes each by chance (1/2, 1/3, 1/5, 4/5, like parity, mod 3, mod 5 and the digit count); a malformed one fails all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge.config import ConfigError, RunConfig
from forge.errors import UserError
from forge.rewards.aggregate import EnsembleAggregator, report_metrics
from forge.rewards.ensemble import RewardEnsembleConfig, WeakVerifierEnsemble
from forge.rewards.latent_class import LatentClassConfig, LatentClassEnsemble

CHANCE = (0.5, 1 / 3, 0.2, 0.8)  # pass rate of a well-formed wrong answer per check


def make_checks(n: int = 2048, correct: float = 0.05, malformed: float = 0.7, seed: int = 0):
    """scores [n, 4] in {0, 1}, groups [n] (16 per prompt), labels [n]."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[correct, 1 - correct - malformed, malformed])  # 0 right, 1 wrong, 2 junk
    chance = np.stack([rng.random(n) < c for c in CHANCE], axis=1)
    scores = np.where(kind[:, None] == 0, 1.0, np.where(kind[:, None] == 1, chance, 0.0))
    return scores.astype(np.float64), np.arange(n) // 16, (kind == 0).astype(np.float64)


def auroc(p: np.ndarray, y: np.ndarray) -> float:
    pos, neg = p[y == 1], p[y == 0]
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_failed_check_means_wrong_without_labels(seed):
    scores, groups, labels = make_checks(seed=seed)
    ens = LatentClassEnsemble(LatentClassConfig(classes=3, seed=seed)).fit(scores, groups)
    p = ens.predict_proba(scores, groups)
    assert auroc(p, labels) > 0.99
    assert ens.report()["class_balance"] == pytest.approx(labels.mean(), abs=0.02)
    one_short = scores.sum(axis=1) == 3  # passed 3 of the 4 checks: wrong by construction
    assert p[one_short].mean() < 0.3 and p[labels == 1].min() > 0.8  # a sharp reward: right ones stand out


def test_gaussian_ensemble_gives_partial_credit_where_latent_classes_do_not():
    """The reason for the model: a linear discriminant on normal scores pays for 3 of 4 checks almost in full."""
    scores, groups, labels = make_checks(seed=0)
    gauss = WeakVerifierEnsemble().fit(scores, groups).predict_proba(scores, groups)
    latent = LatentClassEnsemble().fit(scores, groups).predict_proba(scores, groups)
    one_short = scores.sum(axis=1) == 3
    assert latent[one_short].mean() < 0.3 and gauss[one_short].mean() > 0.8


def popular_near_miss(seed: int):
    """What RL produces: 40% of candidates one popular wrong answer that fails only the last check, 10% right."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=2048, p=[0.1, 0.4, 0.5])  # 0 right, 1 popular near miss, 2 scattered wrong
    chance = np.stack([rng.random(2048) < c for c in CHANCE], axis=1)
    scores = np.where(kind[:, None] == 0, 1.0, np.where(kind[:, None] == 1, np.array([1.0, 1, 1, 0]), chance))
    return scores.astype(np.float64), np.arange(2048) // 16, kind


@pytest.mark.parametrize("seed", [0, 1])
def test_necessary_checks_stop_a_popular_near_miss_from_passing_for_correct(seed):
    scores, groups, kind = popular_near_miss(seed)
    free = LatentClassEnsemble(LatentClassConfig(classes=3)).fit(scores, groups).predict_proba(scores, groups)
    assert free[kind == 1].mean() > 0.9  # the failure mode: "right, with a noisy last check"
    pinned = LatentClassEnsemble(LatentClassConfig(classes=3, necessary=(0, 1, 2, 3))).fit(scores, groups)
    p = pinned.predict_proba(scores, groups)
    assert p[kind == 1].max() < 0.01 and auroc(p, (kind == 0).astype(float)) > 0.99
    assert p[kind == 0].min() > 10 * p[kind == 1].max()  # (a scattered wrong one passing all 4 ties with right)


def test_missing_scores_keep_every_candidate():
    scores, groups, labels = make_checks(seed=3)
    holes = scores.copy()
    holes[np.random.default_rng(3).random(holes.shape) < 0.2] = np.nan
    ens = LatentClassEnsemble().fit(holes, groups)
    p = ens.predict_proba(holes, groups)
    assert np.isfinite(p).all() and auroc(p, labels) > 0.97
    assert ens.report()["missing_share"] == pytest.approx([0.2] * 4, abs=0.03)


def test_continuous_scores_are_cut_at_quantiles_and_the_fit_is_deterministic():
    scores, groups, labels = make_checks(seed=4)
    rng = np.random.default_rng(4)
    judge = labels + rng.normal(0, 0.7, len(labels))  # a continuous verifier: cut into `levels` quantile bins
    scores = np.concatenate([scores, judge[:, None]], axis=1)
    a = LatentClassEnsemble(LatentClassConfig(levels=4)).fit(scores, groups, names=list("pqrsj"))
    b = LatentClassEnsemble(LatentClassConfig(levels=4)).fit(scores, groups, names=list("pqrsj"))
    assert np.array_equal(a.predict_proba(scores, groups), b.predict_proba(scores, groups))
    rep = a.report()
    assert rep["names"] == list("pqrsj") and rep["est_auroc"][4] > 0.7 and all(w > 0 for w in rep["weights"])


def test_errors_are_user_errors():
    with pytest.raises(UserError, match="call fit"):
        LatentClassEnsemble().predict_proba(np.zeros((2, 1)), np.zeros(2))
    with pytest.raises(UserError, match="classes"):
        LatentClassConfig(classes=1)
    with pytest.raises(UserError, match="necessary_checks.*'mod7'"):
        EnsembleAggregator(["parity"], RewardEnsembleConfig(window_steps=4, model="latent_class", necessary_checks=["mod7"]))
    with pytest.raises(UserError, match="necessary_checks.*'mod7'"):
        EnsembleAggregator(["parity"], RewardEnsembleConfig(window_steps=4, model="gaussian", necessary_checks=["mod7"]))
    cfg = RunConfig()
    cfg.reward.ensemble.classes = 1
    with pytest.raises(ConfigError, match="reward.ensemble.classes"):
        cfg.validate()


def test_aggregator_with_latent_classes_rewards_only_the_all_pass_candidates():
    scores, _, labels = make_checks(n=256, correct=0.1, malformed=0.3, seed=5)
    agg = EnsembleAggregator(["parity", "mod3", "mod5", "digits"], RewardEnsembleConfig(window_steps=4, model="latent_class", classes=3))
    rewards, report = agg(torch.tensor(scores, dtype=torch.float32), group_size=16, step=1)
    right = torch.tensor(labels == 1)
    assert rewards[right].min() > 0.5 and rewards[~right].mean() < 0.15
    assert report_metrics(report)["ensemble/accepted"] == 1.0
