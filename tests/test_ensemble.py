"""Label-free weak-verifier ensemble: normal scores, missing scores, duplicates, the report, labels, errors.

The data are small synthetic tasks built here: B prompts x K candidates, U-shaped per-prompt success rates, and
verifiers whose latent score is gap * correct + noise, shown as a logit, a probability, a 1-10 grade or a 0/1 check.
The benchmark (bench/verifier_ensemble.py) holds the harder generator and the numbers; these tests pin behaviour.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from forge.errors import UserError
from forge.rewards import ensemble as E
from forge.rewards.ensemble import EnsembleConfig, WeakVerifierEnsemble

GAPS = [1.6, 1.2, 1.0, 0.8, 0.6, 0.0, -0.6]  # separation in noise sds: strong ... useless (0.0), adversarial (-0.6)
NAMES = ["strong", "good", "ok", "fair", "weak", "useless", "adversarial"]


def make_task(prompts: int = 300, k: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scores [B*K, 7], groups [B*K], labels [B*K]; 40% correct on average, most prompts all right or all wrong."""
    rng = np.random.default_rng(seed)
    rate = rng.beta(0.4, 0.6, size=prompts)
    labels = (rng.random((prompts, k)) < rate[:, None]).astype(np.float64).reshape(-1)
    cols = []
    for i, gap in enumerate(GAPS):
        u = gap * labels + rng.normal(size=len(labels))
        kind = i % 4
        if kind == 0:
            cols.append(2.5 * u - 1.0)  # logit
        elif kind == 1:
            cols.append(1.0 / (1.0 + np.exp(-u)))  # probability
        elif kind == 2:
            cols.append(np.clip(np.round(5.5 + 2.0 * u), 1, 10))  # 1-10 grade
        else:
            cols.append((u > 0.3).astype(np.float64))  # 0/1 check
    return np.stack(cols, axis=1), np.repeat(np.arange(prompts), k), labels


def select_at_1(p: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Percent of prompts whose top-scored candidate is correct (ties count as a uniform pick)."""
    s, y = p.reshape(-1, k), labels.reshape(-1, k)
    top = s >= s.max(axis=1, keepdims=True)
    return 100.0 * float(((top * y).sum(axis=1) / top.sum(axis=1)).mean())


def auroc(p: np.ndarray, y: np.ndarray) -> float:
    pos, neg = p[y == 1], p[y == 0]
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


@pytest.fixture(scope="module")
def task():
    return make_task()


@pytest.fixture(scope="module")
def fitted(task):
    scores, groups, _ = task
    return WeakVerifierEnsemble().fit(scores, groups, names=NAMES)


# ---------------------------------------------------------------- normal scores


def test_ndtri_inverts_the_normal_cdf():
    p = np.array([1e-12, 1e-6, 0.01, 0.02425, 0.3, 0.5, 0.7, 0.97575, 0.999, 1 - 1e-9])
    x = E._ndtri(p)
    back = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
    assert np.allclose(back, p, rtol=1e-7, atol=0)  # x is good to ~1e-9 relative; p inherits ~|x| times that
    assert E._ndtri(np.array([0.5]))[0] == pytest.approx(0.0, abs=1e-12)


def test_normal_scores_keep_order_share_ties_and_nan():
    col = np.array([3.0, 1.0, 1.0, np.nan, 7.0, 2.0])
    tf = E._fit_transform(col[:, None], max_knots=2048)
    z = E._apply_transform(tf, col[:, None])[:, 0]
    assert np.isnan(z[3])
    assert z[1] == z[2] < z[5] < z[0] < z[4]  # the tie block [1, 1] shares one value
    # a 0/1 check at 50/50: each half gets the mean of its half of N(0, 1), -+ sqrt(2 / pi) ~ 0.798
    half = E._apply_transform(E._fit_transform(np.array([[0.0], [1.0]]), 2048), np.array([[0.0], [1.0]]))[:, 0]
    assert half == pytest.approx([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], rel=1e-6)


def test_dithered_scores_are_standard_normal_and_copy_proof():
    rng = np.random.default_rng(1)
    col = (rng.random(4000) < 0.3).astype(np.float64)  # one big tie block per value
    z = E._dithered_normal_scores(np.stack([col, col], axis=1), seed=0)
    assert abs(z[:, 0].mean()) < 0.05 and abs(z[:, 0].std() - 1.0) < 0.05
    assert np.array_equal(z[:, 0], z[:, 1])  # identical columns, identical draws: a copy stays a copy


# ---------------------------------------------------------------- what the fit recovers


def test_estimates_balance_and_ranks_without_labels(task, fitted):
    scores, groups, labels = task
    p = fitted.predict_proba(scores, groups)
    assert p.shape == labels.shape and np.all((p >= 0) & (p <= 1))
    assert fitted.report()["class_balance"] == pytest.approx(labels.mean(), abs=0.05)
    naive = np.mean([E._apply_transform(E._fit_transform(scores[:, [v]], 2048), scores[:, [v]])[:, 0]
                     for v in range(scores.shape[1])], axis=0)  # fmt: skip
    assert auroc(p, labels) > auroc(naive, labels) + 0.02  # the adversarial and useless verifiers drag the mean
    assert abs(np.mean((p - labels) ** 2)) < 0.12  # Brier: calibrated probabilities, not just a ranking


def test_report_content(fitted):
    r = fitted.report()
    for key in (
        "class_balance",
        "class_shares",
        "names",
        "est_auroc",
        "weights",
        "missing_share",
        "dependent_groups",
        "within_class_corr",
        "start",
        "iterations",
        "n_candidates",
        "n_fit_rows",
    ):
        assert key in r, key  # fmt: skip
    assert r["names"] == NAMES and len(r["est_auroc"]) == len(r["weights"]) == len(NAMES)
    assert sum(r["class_shares"]) == pytest.approx(1.0, abs=1e-3)
    auc = dict(zip(NAMES, r["est_auroc"], strict=True))
    assert auc["strong"] > auc["good"] > auc["weak"] > 0.55
    assert abs(auc["useless"] - 0.5) < 0.05
    assert auc["adversarial"] < 0.4
    w = dict(zip(NAMES, r["weights"], strict=True))
    assert w["adversarial"] < 0 < w["weak"]  # an adversarial verifier is used upside down, not dropped
    assert r["n_candidates"] == 2400 and r["n_groups"] == 300 and r["n_labels"] == 0


def test_within_prompt_ties_are_rare_even_with_discrete_verifiers(task, fitted):
    scores, groups, _ = task
    keep = [2, 3]  # only the 1-10 grade and the 0/1 check: at most 20 distinct score pairs
    p = WeakVerifierEnsemble().fit(scores[:, keep], groups).predict_proba(scores[:, keep], groups)
    s = p.reshape(-1, 8)
    ties = (s[:, :, None] == s[:, None, :])[:, np.triu(np.ones((8, 8), dtype=bool), 1)].mean()
    assert ties > 0.03  # two discrete verifiers cannot separate everything...
    p_all = fitted.predict_proba(scores, groups).reshape(-1, 8)
    ties_all = (p_all[:, :, None] == p_all[:, None, :])[:, np.triu(np.ones((8, 8), dtype=bool), 1)].mean()
    assert ties_all < 0.001  # ...but one continuous verifier among them is enough


# ---------------------------------------------------------------- dependence and duplicates


@pytest.mark.parametrize("copied", ["fair", "adversarial"])
def test_five_copies_of_a_verifier_move_select_at_1_by_under_one_point(copied):
    scores, groups, labels = make_task(prompts=500, seed=3)
    v = NAMES.index(copied)
    dup = np.concatenate([scores] + [scores[:, [v]]] * 5, axis=1)
    base = select_at_1(WeakVerifierEnsemble().fit(scores, groups).predict_proba(scores, groups), labels, 8)
    ens = WeakVerifierEnsemble().fit(dup, groups, names=NAMES + [f"{copied}_{i}" for i in range(5)])
    assert abs(select_at_1(ens.predict_proba(dup, groups), labels, 8) - base) < 1.0
    assert [copied] + [f"{copied}_{i}" for i in range(5)] in ens.report()["dependent_groups"]


# ---------------------------------------------------------------- missing scores


def test_missing_scores_are_integrated_out_exactly():
    """E-step statistics against brute force: log N(z_o | mu_k,o, S_oo) row by row, with the matrices sliced."""
    rng = np.random.default_rng(1)
    v, k = 5, 3
    a = rng.normal(size=(v, v))
    params = E._Params(np.array([0.3, 0.3, 0.4]), rng.normal(size=(k, v)), a @ a.T / v + np.eye(v))
    z = rng.normal(size=(60, v))
    z[rng.random(z.shape) < 0.3] = np.nan
    z[0] = np.nan  # a row with nothing observed
    got = E._marginal_loglik(E._Rows.of(z), params)
    for i in range(len(z)):
        o = ~np.isnan(z[i])
        for c in range(k):
            s, d = params.cov[np.ix_(o, o)], z[i, o] - params.means[c, o]
            want = -0.5 * (d @ np.linalg.solve(s, d) + np.linalg.slogdet(s)[1] + o.sum() * math.log(2 * math.pi))
            assert got[i, c] == pytest.approx(want if o.any() else 0.0, abs=1e-9)


def test_missing_scores_keep_every_candidate_and_cost_little(task, fitted):
    scores, groups, labels = task
    holey = scores.copy()
    holey[np.random.default_rng(2).random(holey.shape) < 0.2] = np.nan  # a fifth of all scores lost
    holey[5] = np.nan  # and one candidate with no score at all
    ens = WeakVerifierEnsemble().fit(holey, groups)
    p = ens.predict_proba(holey, groups)
    assert np.isfinite(p).all()
    assert p[5] == pytest.approx(ens.report()["class_balance"], abs=1e-4)  # nothing observed: the prior
    full = select_at_1(fitted.predict_proba(scores, groups), labels, 8)
    assert select_at_1(p, labels, 8) > full - 4.0
    assert ens.report()["missing_share"][0] == pytest.approx(0.2, abs=0.03)


# ---------------------------------------------------------------- labels, determinism, speed, errors


def test_labels_are_optional_and_overrule_the_orientation():
    scores, groups, labels = make_task(seed=4)
    flipped = -scores  # now most verifiers score wrong answers higher: label-free, the classes come out swapped
    unlabelled = WeakVerifierEnsemble().fit(flipped, groups).predict_proba(flipped, groups)
    assert auroc(unlabelled, labels) < 0.2
    few = np.full(len(labels), np.nan)
    idx = np.random.default_rng(0).choice(len(labels), size=48, replace=False)  # 2% of candidates labelled
    few[idx] = labels[idx]
    ens = WeakVerifierEnsemble().fit(flipped, groups, labels=few)
    assert auroc(ens.predict_proba(flipped, groups), labels) > 0.85
    assert ens.report()["n_labels"] == 48


def test_fit_is_deterministic(task):
    scores, groups, _ = task
    p1 = WeakVerifierEnsemble().fit(scores, groups).predict_proba(scores, groups)
    p2 = WeakVerifierEnsemble().fit(scores, groups).predict_proba(scores, groups)
    assert np.array_equal(p1, p2)


def test_fit_handles_many_rows_by_subsampling_prompts():
    """Speed sanity (no timing assertion; the benchmark times 100,000 x 30): EM runs on a bounded subset."""
    rng = np.random.default_rng(5)
    n, v = 30_000, 12
    y = rng.random(n) < 0.3
    scores = rng.normal(size=(n, v)) + np.linspace(0.2, 1.5, v) * y[:, None]
    scores[rng.random((n, v)) < 0.05] = np.nan
    cfg = EnsembleConfig(max_fit_rows=8_000, screen_rows=2_000)
    ens = WeakVerifierEnsemble(cfg).fit(scores, np.arange(n) // 10)
    assert ens.report()["n_fit_rows"] <= 8_000 and ens.report()["n_candidates"] == n
    p = ens.predict_proba(scores, np.arange(n) // 10)
    assert np.isfinite(p).all() and auroc(p[:3000], y[:3000]) > 0.9


def test_errors_are_one_line_and_name_the_problem(task):
    scores, groups, _ = task
    with pytest.raises(UserError, match="call fit"):
        WeakVerifierEnsemble().predict_proba(scores, groups)
    with pytest.raises(UserError, match="one prompt id per row"):
        WeakVerifierEnsemble().fit(scores, groups[:-1])
    with pytest.raises(UserError, match="use NaN"):
        WeakVerifierEnsemble().fit(np.where(scores > 5, np.inf, scores), groups)
    with pytest.raises(UserError, match="labels must be 0, 1 or NaN"):
        WeakVerifierEnsemble().fit(scores, groups, labels=np.full(len(groups), 0.5))
    with pytest.raises(UserError, match="fit saw 7 verifiers"):
        WeakVerifierEnsemble().fit(scores, groups).predict_proba(scores[:, :3], groups)


def test_module_imports_numpy_only():
    """forge must import where only torch/transformers/accelerate/safetensors/numpy are installed."""
    tree = ast.parse(Path(E.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    stdlib = {"__future__", "collections", "dataclasses", "hashlib", "math", "typing"}  # typing: the config section
    assert imported <= stdlib | {"numpy", "forge"}, imported
