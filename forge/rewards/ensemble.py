"""Label-free weak-verifier ensemble: P(candidate correct | the scores of V weak verifiers), fit without labels.

Shapes: N candidates (B prompts x G samples, flattened), V verifiers, K latent classes. `scores` is [N, V] with
NaN where a verifier gave no score; `groups` is [N] (prompt id). Labels are optional and never needed.

The model: a Gaussian mixture with K classes (default 3) and one shared within-class covariance, on normal scores
(unsupervised LDA). Class 0 is "correct"; the others are kinds of wrong. Three, not two, because LLM samples are
wrong in two ways: scattered slips, and a popular wrong answer many samples share, which answer agreement and
partly-fooled judges score almost like the right one. With two classes the likelihood prefers "popular answer vs
the rest" to "right vs wrong" whenever popular wrong answers are common.

1. Normal scores. Each verifier's scores are replaced by normal scores of their ranks, so only the order a verifier
   puts candidates in matters: logits, probabilities, 1-10 grades and 0/1 checks mix freely. For fitting, a tie
   block (all the 0s of a 0/1 check) is spread over its slice of N(0, 1) by a draw seeded from the column's bytes
   (identical columns get identical draws); otherwise a big tie block looks like a cluster the mixture latches
   onto. For prediction a tie block gets the mean of its slice (the expected value of the linear discriminant).
2. EM for class shares, class means [K, V] and one within-class covariance S [V, V] (plus a ridge). S holds what
   correlates verifiers beyond correctness -- a shared length bias, reward models from one base model,
   duplicates -- so the discriminant S^-1 (mu_0 - mu_k) discounts it, and an exact copy splits its verifier's weight
   instead of adding to it. Missing scores are integrated out exactly: the E-step fills them with their conditional
   mean given the row's observed scores (per class) and adds the conditional covariance in the M-step, so a
   candidate is never dropped. EM is accelerated with SQUAREM (Varadhan & Roland, 2008).
3. Starts and choice. The likelihood has several optima (a length factor, a popular wrong answer). Starts: a
   one-factor moment fit (loadings from the median of triplet ratios C_ij C_ik / C_jk, refit without pairs flagged
   as dependent: the agreement-based initialisation of Snorkel/FlyingSquid), the same on per-prompt mean scores,
   the plain mean, and each distinct verifier alone; each is cut into K quantile bins. Every start gets a few EM
   steps on a few prompts, the best `finalists` run to convergence there, and the winner is refit on the fit rows.
   The choice is by likelihood under a leave-one-out per-prompt prior (a candidate's class prior is the posterior
   share of each class among the other candidates of its prompt, shrunk to the global share): correctness
   clusters by prompt (U-shaped difficulty), length and reward-model quirks mostly do not.
4. Orientation: the class that verifiers score highest (largest sum over v of mu_kv / sd_v, a verifier in a
   dependent group of size s counting 1/s) is "correct". With labels, labelled rows are clamped (a 1 to class 0,
   a 0 to the wrong classes) in every E-step instead.
5. Output: the posterior of class 0 with the global shares as prior: continuous, so candidates of one prompt rarely
   tie, and a candidate's reward does not depend on the other candidates' scores (the per-prompt prior is used
   only to choose between starts).

Speed: the normal-score transform uses every row; EM runs on at most `max_fit_rows` rows (whole prompts drawn with
a fixed seed), plenty for V means and a V x V covariance with V up to a few dozen.

Where this departs from Weaver (Saad-Falcon et al., 2025): no min-max + threshold binarisation (normal scores, so
rewards do not tie); the class balance is estimated, not set from labels; no drop rule (a useless verifier gets a
weight near 0, an adversarial one a negative weight); a Gaussian mixture with a "convincing wrong" class fit by
EM to convergence, instead of a binary two-class Snorkel label model fit by moment matching; verifiers are not
assumed conditionally independent: their within-class covariance is estimated and used
(`report()["dependent_groups"]` lists the strongly dependent ones).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from forge.config_base import ranged
from forge.errors import UserError


@dataclass(kw_only=True)
class RewardEnsembleConfig:
    """`reward.ensemble`: the label-free ensemble reward (`reward.aggregate: ensemble`; forge.rewards.aggregate)."""

    window_steps: int = ranged(8, ">= 1")
    """Steps of recent scored rollouts the ensemble is fit on."""
    refit_every: int = ranged(1, ">= 1")
    """Refit every this many steps."""
    model: Literal["gaussian", "latent_class"] = "gaussian"
    """gaussian (any scores) or latent_class (discrete checks; forge/rewards/latent_class.py)."""
    classes: int = ranged(3, ">= 2", "(correct and wrong)")
    """Latent classes, correct plus kinds of wrong."""
    necessary_checks: list[str] = field(default_factory=list)
    """Verifiers every correct answer passes (rule checks); failing one means wrong (latent_class: pins the correct
    class; gaussian: P(correct) = 0 for a completion that failed one)."""


@dataclass(frozen=True)
class EnsembleConfig:
    classes: int = 3
    """Latent classes K: correct plus K - 1 kinds of wrong (2 = the classic right/wrong label model)."""
    ridge: float = 0.05
    """Added to the within-class covariance diagonal (unit-variance scores): near-duplicates share a weight."""
    max_iter: int = 60
    """EM steps at most per finalist."""
    refit_iter: int = 15
    """EM steps at most for the refit of the winner on the fit rows (it starts at its own optimum)."""
    tol: float = 5e-4
    """EM stops when the mean change of P(class 0) between SQUAREM cycles is below this."""
    max_fit_rows: int = 20_000
    """The final EM runs on at most this many rows (whole prompts, fixed seed); the score transform uses all rows."""
    screen_rows: int = 4_000
    """Starts are screened and the finalists run to convergence on at most this many rows (whole prompts)."""
    screen_iter: int = 6
    """EM steps each start gets before the screen keeps the best `finalists`."""
    verifier_starts: int = 8
    """Single-verifier starts: the distinct verifiers with the largest moment loadings, at most this many."""
    finalists: int = 3
    """Starts run to convergence after the screen; the best by score is refit on the fit rows."""
    prompt_prior_strength: float = 2.0
    """Pseudo-count pulling a prompt's leave-one-out class shares towards the global ones (start choice only)."""
    dependence_threshold: float = 0.2
    """Within-class correlation above which verifiers count as dependent (moment start and the report)."""
    max_knots: int = 2048
    """Score-to-normal-score knots kept per verifier for scoring new candidates."""
    seed: int = 0
    """Seed for the tie-spreading draws and the choice of fit rows; fit is deterministic given it."""

    def __post_init__(self) -> None:
        assert self.classes >= 2, "EnsembleConfig.classes: need a correct class and at least one wrong class"


@dataclass(frozen=True)
class EnsembleReport:
    class_balance: float  # estimated share of correct candidates
    class_shares: list[float]  # [K] classes from most to least correct-looking
    correct_classes: int  # how many of the first classes count as correct (1, or 2 when "less sure but right")
    names: list[str]  # [V]
    est_auroc: list[float]  # [V] model-implied AUROC, correct vs all wrong (< 0.5: scores wrong answers higher)
    weights: list[float]  # [V] discriminant weight on each verifier's normal score, correct vs all wrong
    missing_share: list[float]  # [V] share of fit candidates the verifier did not score
    dependent_groups: list[list[str]]  # verifiers correlated beyond what the classes explain (average linkage)
    within_class_corr: list[list[float]]  # [V, V] correlation between verifiers within a class
    start: str  # which start won: "moments", "prompt-means", "mean" or "verifier <name>"
    iterations: int  # EM steps of the final fit
    n_candidates: int
    n_groups: int
    n_fit_rows: int  # rows the final EM ran on
    n_labels: int  # labelled fit rows clamped during EM (0 = label-free)


@dataclass(frozen=True)
class _Transform:
    knots_x: list[np.ndarray]  # per verifier: sorted distinct raw scores (thinned when continuous)
    knots_z: list[np.ndarray]  # per verifier: mean normal score of each one's slice


@dataclass(frozen=True)
class _Params:
    shares: np.ndarray  # [K] class shares; once oriented, ordered from most to least correct-looking
    means: np.ndarray  # [K, V] mean normal score per class
    cov: np.ndarray  # [V, V] within-class covariance, ridge included
    correct: int = 1  # the first `correct` classes (once oriented) are the correct ones


@dataclass(frozen=True)
class _Fit:
    params: _Params
    q: np.ndarray  # [n, K] posteriors on the rows it was fit on
    iterations: int
    score: float  # mean log-likelihood under the leave-one-out prompt prior


class WeakVerifierEnsemble:
    """Fit on unlabeled verifier scores; predict P(correct). See the module docstring for the method."""

    def __init__(self, config: EnsembleConfig | None = None) -> None:
        self.config = config or EnsembleConfig()
        self._transform: _Transform | None = None
        self._params: _Params | None = None
        self._report: EnsembleReport | None = None

    def fit(
        self,
        scores: np.ndarray,
        groups: np.ndarray,
        labels: np.ndarray | None = None,
        names: Sequence[str] | None = None,
    ) -> WeakVerifierEnsemble:
        """scores [N, V] (NaN = missing), groups [N] prompt ids, labels [N] in {0, 1} or NaN (optional)."""
        scores, groups = _check_inputs(scores, groups)
        names = _check_names(names, scores.shape[1])
        labels = _check_labels(labels, len(scores))
        cfg = self.config
        self._transform = _fit_transform(scores, cfg.max_knots)
        rows = _subsample(groups, cfg.max_fit_rows, cfg.seed)
        z = _dithered_normal_scores(scores[rows], cfg.seed)  # [n_fit, V]
        g, y = groups[rows], None if labels is None else labels[rows]
        start, params = _choose_start(z, g, y, cfg)
        data = _Rows.of(z)
        fit = _em(data, g, y, _posterior(z, params), cfg, cfg.refit_iter)
        if y is None:  # label-free: decide which classes are the correct ones
            self._params = _count_correct(data, g, _orient(fit.params, cfg.dependence_threshold), cfg)
        else:  # labelled rows pinned class 0 to "correct"
            self._params = fit.params
        self._report = _make_report(self._params, fit, start, z, groups, names, y, cfg)
        return self

    def predict_proba(self, scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """[N] probability that each candidate is correct."""
        if self._params is None or self._transform is None:
            raise UserError("WeakVerifierEnsemble.predict_proba: call fit(scores, groups) first")
        scores, groups = _check_inputs(scores, groups, n_verifiers=self._params.means.shape[1])
        p = self._params
        return _posterior(_apply_transform(self._transform, scores), p)[:, : p.correct].sum(axis=1)

    def report(self) -> dict:
        """Estimated class balance, per-verifier quality and weights, dependent groups (a JSON-able dict)."""
        if self._report is None:
            raise UserError("WeakVerifierEnsemble.report: call fit(scores, groups) first")
        return asdict(self._report)

    def state_dict(self) -> dict:
        """The fitted model as arrays and JSON values (for checkpoints): `load_state_dict` predicts the same."""
        if self._params is None or self._transform is None or self._report is None:
            raise UserError("WeakVerifierEnsemble.state_dict: call fit(scores, groups) first")
        return {"transform": asdict(self._transform), "params": asdict(self._params), "report": asdict(self._report)}

    def load_state_dict(self, state: dict) -> WeakVerifierEnsemble:
        tf, p = state["transform"], state["params"]
        self._transform = _Transform([np.asarray(x) for x in tf["knots_x"]], [np.asarray(z) for z in tf["knots_z"]])
        self._params = _Params(np.asarray(p["shares"]), np.asarray(p["means"]), np.asarray(p["cov"]), int(p["correct"]))
        self._report = EnsembleReport(**state["report"])
        return self


# ---------------------------------------------------------------- inputs


def _check_inputs(
    scores: np.ndarray, groups: np.ndarray, n_verifiers: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64)
    groups = np.asarray(groups)
    if scores.ndim != 2 or scores.shape[0] < 2 or scores.shape[1] < 1:
        raise UserError(f"ensemble: scores must be a [N, V] array with N >= 2, got shape {scores.shape}")
    if n_verifiers is not None and scores.shape[1] != n_verifiers:
        raise UserError(f"ensemble: fit saw {n_verifiers} verifiers but scores has {scores.shape[1]} columns")
    if groups.shape != (scores.shape[0],):
        raise UserError(f"ensemble: groups must hold one prompt id per row ({scores.shape[0]}), got {groups.shape}")
    if np.isinf(scores).any():
        raise UserError("ensemble: scores hold +-inf; use NaN for a missing score")
    return scores, groups


def _check_names(names: Sequence[str] | None, v: int) -> list[str]:
    if names is None:
        return [f"v{i}" for i in range(v)]
    if len(names) != v:
        raise UserError(f"ensemble: {len(names)} names for {v} verifier columns")
    return [str(n) for n in names]


def _check_labels(labels: np.ndarray | None, n: int) -> np.ndarray | None:
    if labels is None:
        return None
    labels = np.asarray(labels, dtype=np.float64)
    if labels.shape != (n,):
        raise UserError(f"ensemble: labels must hold one entry per row ({n}), NaN = unknown; got {labels.shape}")
    seen = labels[~np.isnan(labels)]
    if not np.isin(seen, (0.0, 1.0)).all():
        raise UserError("ensemble: labels must be 0, 1 or NaN (unknown)")
    return labels if len(seen) else None


def _subsample(groups: np.ndarray, max_rows: int, seed: int) -> np.ndarray:
    """All rows, or the rows of whole prompts drawn at random until max_rows."""
    if len(groups) <= max_rows:
        return np.arange(len(groups))
    uniq, inverse = np.unique(groups, return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(uniq))
    sizes = np.bincount(inverse)[order]
    chosen = np.zeros(len(uniq), dtype=bool)
    chosen[order[: max(1, int(np.searchsorted(np.cumsum(sizes), max_rows, side="right")))]] = True
    return np.flatnonzero(chosen[inverse])


# ---------------------------------------------------------------- normal scores


def _ndtri(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, relative error < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)  # fmt: skip
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)  # fmt: skip
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)  # fmt: skip
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-300, 1 - 1e-16)
    tail = np.sqrt(-2.0 * np.log(np.minimum(p, 1.0 - p)))
    x_tail = np.polyval(c, tail) / (np.polyval(d, tail) * tail + 1.0)
    q = p - 0.5
    x_mid = np.polyval(a, q * q) * q / (np.polyval(b, q * q) * q * q + 1.0)
    low = 0.02425
    return np.where(p < low, x_tail, np.where(p > 1 - low, -x_tail, x_mid))


def _normal_pdf_at_quantile(f: np.ndarray) -> np.ndarray:
    """phi(Phi^-1(f)); 0 at f = 0 and f = 1."""
    inside = (f > 0) & (f < 1)
    x = _ndtri(np.where(inside, f, 0.5))
    return np.where(inside, np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi), 0.0)


def _slices(col: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Distinct values, their index per present row, and the [lo, hi) slice of N(0, 1) each one covers."""
    values, inverse, counts = np.unique(col[~np.isnan(col)], return_inverse=True, return_counts=True)
    hi = np.cumsum(counts) / max(counts.sum(), 1)
    return values, inverse, hi - counts / max(counts.sum(), 1), hi


def _column_knots(col: np.ndarray, max_knots: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct scores and E[Z | Z in the slice of N(0, 1) the tie block covers]."""
    values, inverse, lo, hi = _slices(col)
    if len(values) == 0:
        return np.zeros(1), np.zeros(1)
    z = (_normal_pdf_at_quantile(lo) - _normal_pdf_at_quantile(hi)) / (hi - lo)
    if len(values) > max_knots:  # keep every big tie block exactly, thin the continuous part
        keep = (hi - lo) > 1.0 / max_knots
        keep[np.linspace(0, len(values) - 1, max_knots).astype(int)] = True
        values, z = values[keep], z[keep]
    return values, z


def _fit_transform(scores: np.ndarray, max_knots: int) -> _Transform:
    knots = [_column_knots(scores[:, v], max_knots) for v in range(scores.shape[1])]
    return _Transform([k[0] for k in knots], [k[1] for k in knots])


def _apply_transform(tf: _Transform, scores: np.ndarray) -> np.ndarray:
    z = np.empty_like(scores)
    for v, (kx, kz) in enumerate(zip(tf.knots_x, tf.knots_z, strict=True)):
        z[:, v] = np.interp(scores[:, v], kx, kz)  # NaN in, NaN out
    return z  # [N, V]


def _dithered_normal_scores(scores: np.ndarray, seed: int) -> np.ndarray:
    """Normal scores with each tie block spread uniformly over its slice: every column is exactly N(0, 1)."""
    z = np.full(scores.shape, np.nan)
    for v in range(scores.shape[1]):
        col = scores[:, v]
        present = ~np.isnan(col)
        _, inverse, lo, hi = _slices(col)
        digest = hashlib.sha256(np.ascontiguousarray(col).tobytes()).digest()
        rng = np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])
        z[present, v] = _ndtri(np.clip(lo[inverse] + rng.random(len(inverse)) * (hi - lo)[inverse], 1e-12, 1 - 1e-12))
    return z


# ---------------------------------------------------------------- starts


def _choose_start(
    z: np.ndarray, groups: np.ndarray, labels: np.ndarray | None, cfg: EnsembleConfig
) -> tuple[str, _Params]:
    """Screen every start briefly on a few prompts, run the best few to convergence, return the best (by score)."""
    keep = _subsample(groups, cfg.screen_rows, cfg.seed + 1)
    zs, gs, ys = z[keep], groups[keep], None if labels is None else labels[keep]
    rows = _Rows.of(zs)
    starts = _starts(zs, gs, cfg)
    short = {name: _em(rows, gs, ys, q0, cfg, cfg.screen_iter) for name, q0 in starts.items()}
    finalists = sorted(short, key=lambda k: short[k].score, reverse=True)[: cfg.finalists]
    long = {name: _em(rows, gs, ys, short[name].q, cfg, cfg.max_iter) for name in finalists}
    best = max(long, key=lambda k: long[k].score)
    return best, long[best].params


def _starts(z: np.ndarray, groups: np.ndarray, cfg: EnsembleConfig) -> dict[str, np.ndarray]:
    """Initial posteriors [n, K]: moment loadings, the same on prompt means, the plain mean, single verifiers."""
    filled = np.nan_to_num(z)
    k, threshold = cfg.classes, cfg.dependence_threshold
    loadings, clusters = _factor_with_dependence(_pairwise_corr(z), threshold)
    starts = {
        "moments": _bins(filled @ _moment_weights(loadings, clusters), k),
        "prompt-means": _bins(filled @ _moment_weights(*_factor_with_dependence(
            _pairwise_corr(_prompt_means(z, groups)), threshold)), k),
        "mean": _bins(filled.mean(axis=1), k),  # missing scores count as average
    }  # fmt: skip
    seen: set[bytes] = set()
    for v in np.argsort(-np.abs(loadings), kind="stable"):
        key = filled[:, v].tobytes()
        if key not in seen and len(seen) < cfg.verifier_starts:  # a copy would only repeat its original's run
            seen.add(key)
            starts[f"verifier {v}"] = _bins(filled[:, v], k)
    return starts


def _bins(s: np.ndarray, k: int) -> np.ndarray:
    """[n, K] soft assignment to K equal-count bins of s, highest bin first (class 0 = looks most correct)."""
    rank = np.argsort(np.argsort(s, kind="stable"), kind="stable") / len(s)
    q = np.full((len(s), k), 0.2 / k)
    q[np.arange(len(s)), k - 1 - np.minimum((rank * k).astype(int), k - 1)] += 0.8
    return q


def _pairwise_corr(z: np.ndarray) -> np.ndarray:
    """[V, V] correlations over the rows where both verifiers are present (missing completely at random)."""
    observed = (~np.isnan(z)).astype(np.float64)
    filled = np.nan_to_num(z - np.nanmean(z, axis=0))
    counts = observed.T @ observed
    cov = (filled.T @ filled) / np.maximum(counts, 1.0)
    sd = np.sqrt(np.maximum(np.diag(cov), 1e-12))
    corr = cov / np.outer(sd, sd)
    corr[counts < 3] = 0.0  # pairs never scored together carry no evidence
    np.fill_diagonal(corr, 1.0)
    return corr


def _prompt_means(z: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[n_prompts, V] mean normal score per prompt over the candidates a verifier scored (NaN if none)."""
    _, inverse = np.unique(groups, return_inverse=True)
    observed = ~np.isnan(z)
    sums = np.stack([np.bincount(inverse, weights=np.where(observed[:, v], z[:, v], 0.0)) for v in range(z.shape[1])])
    counts = np.stack([np.bincount(inverse, weights=observed[:, v]) for v in range(z.shape[1])])
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums / counts).T


def _moment_weights(loadings: np.ndarray, clusters: list[np.ndarray]) -> np.ndarray:
    """Naive-Bayes weights l / (1 - l^2) from one-factor loadings, shared out within dependent groups."""
    weights = loadings / np.maximum(1.0 - loadings**2, 0.05)
    for members in clusters:
        weights[members] /= len(members)
    return weights


def _factor_with_dependence(corr: np.ndarray, threshold: float, rounds: int = 6) -> tuple[np.ndarray, list]:
    """Loadings l with C_ij ~ l_i l_j on pairs not flagged dependent; dependent groups by average linkage."""
    loadings = _triplet_loadings(corr)
    clusters: list[np.ndarray] = [np.array([i]) for i in range(len(corr))]
    for _ in range(rounds):
        new = _average_linkage(_residual_corr(corr, loadings), threshold)
        loadings = _rank_one_fit(corr, _cross_cluster_mask(new, len(corr)), loadings)
        if len(new) == len(clusters) and all(np.array_equal(a, b) for a, b in zip(new, clusters, strict=True)):
            break
        clusters = new
    return (loadings if loadings.sum() >= 0 else -loadings), clusters


def _triplet_loadings(corr: np.ndarray, min_corr: float = 0.03) -> np.ndarray:
    """|l_i| = sqrt(median over j, k of C_ij C_ik / C_jk); a few dependent pairs cannot move a median."""
    v = len(corr)
    mags = np.zeros(v)
    for i in range(v):
        others = np.delete(np.arange(v), i)
        cj, ck = np.meshgrid(corr[i, others], corr[i, others], indexing="ij")
        cjk = corr[np.ix_(others, others)]
        usable = np.triu(np.abs(cjk) > min_corr, k=1)
        if usable.any():
            mags[i] = math.sqrt(max(float(np.median((cj * ck / np.where(usable, cjk, 1.0))[usable])), 0.0))
    off = corr - np.diag(np.diag(corr))
    lead = np.linalg.eigh(off)[1][:, -1]
    return np.minimum(mags, 0.99) * np.where(lead >= 0, 1.0, -1.0)


def _rank_one_fit(corr: np.ndarray, allowed: np.ndarray, init: np.ndarray, iters: int = 300) -> np.ndarray:
    """Least-squares l with C_ij ~ l_i l_j over the allowed off-diagonal pairs (damped coordinate updates)."""
    lam = init.copy()
    weights = allowed.astype(np.float64)
    np.fill_diagonal(weights, 0.0)
    for _ in range(iters):
        den = weights @ (lam * lam)
        new = np.clip(np.where(den > 1e-12, (weights * corr) @ lam / np.maximum(den, 1e-12), 0.0), -0.99, 0.99)
        if np.max(np.abs(new - lam)) < 1e-7:
            return new
        lam = 0.5 * lam + 0.5 * new
    return lam


def _residual_corr(corr: np.ndarray, loadings: np.ndarray) -> np.ndarray:
    """Correlation left after the latent factor, rescaled to a within-class correlation."""
    resid_var = np.maximum(1.0 - loadings**2, 1e-3)
    within = (corr - np.outer(loadings, loadings)) / np.sqrt(np.outer(resid_var, resid_var))
    np.fill_diagonal(within, 1.0)
    return within


def _average_linkage(within: np.ndarray, threshold: float) -> list[np.ndarray]:
    """Merge the two groups of highest mean within-class correlation while it exceeds the threshold."""
    clusters = [[i] for i in range(len(within))]
    while len(clusters) > 1:
        best, pair = threshold, None
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                link = float(within[np.ix_(clusters[a], clusters[b])].mean())
                if link > best:
                    best, pair = link, (a, b)
        if pair is None:
            break
        clusters[pair[0]] = clusters[pair[0]] + clusters.pop(pair[1])
    return [np.array(sorted(c)) for c in sorted(clusters, key=min)]


def _cross_cluster_mask(clusters: list[np.ndarray], v: int) -> np.ndarray:
    """[V, V] True for pairs of verifiers in different dependent groups."""
    label = np.empty(v, dtype=int)
    for k, members in enumerate(clusters):
        label[members] = k
    return label[:, None] != label[None, :]


# ---------------------------------------------------------------- EM with missing scores
#
# A row's missing scores are integrated out exactly with small per-row algebra. With P = S^-1, o the row's observed
# and m its missing verifiers, W = (P_mm)^-1 [k, k] and z~ the row with 0 at m:
#   S_oo^-1 = P_oo - P_om W P_mo,   E[z_m | z_o, class c] = mu_cm - W (P (z~ - mu~_c))_m,   Cov[z_m | z_o] = W,
# where mu~_c is mu_c with 0 at m. Only k-vectors per row are needed: a = (P z~)_m and b_c = (P mu~_c)_m.


@dataclass(frozen=True)
class _Rows:
    """Fit rows with what EM reuses every step."""

    z: np.ndarray  # [n, V] normal scores, NaN = missing
    filled: np.ndarray  # [n, V] the same with 0 where missing
    gram: np.ndarray  # [V, V] filled^T filled
    blocks: list[tuple[np.ndarray, np.ndarray]]  # (rows, their missing columns [R, k]) per count k of missing

    @staticmethod
    def of(z: np.ndarray) -> _Rows:
        filled = np.nan_to_num(z)
        return _Rows(z, filled, filled.T @ filled, _missing_blocks(np.isnan(z)))


@dataclass(frozen=True)
class _Gaps:
    """Per block of rows with k missing scores: what the E-step found, for the M-step and the likelihood."""

    fills: list[np.ndarray]  # [K, R, k] E[z_m | z_o, class]
    cond: list[np.ndarray]  # [R, k, k] W = Cov[z_m | z_o]
    quad: list[np.ndarray]  # [R] a^T W a, for the per-row constant of the likelihood
    logdet: list[np.ndarray]  # [R] log |P_mm|


def _missing_blocks(missing: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, their missing columns [R, k]) for each count k of missing scores."""
    n_missing = missing.sum(axis=1)
    blocks = []
    for k in np.unique(n_missing[n_missing > 0]):
        rows = np.flatnonzero(n_missing == k)
        blocks.append((rows, np.argsort(~missing[rows], axis=1, kind="stable")[:, :k]))
    return blocks


def _em(
    rows: _Rows, groups: np.ndarray, labels: np.ndarray | None, q: np.ndarray, cfg: EnsembleConfig, max_iter: int
) -> _Fit:
    """Tied-covariance Gaussian mixture from posteriors q [n, K]; labelled rows (if any) stay clamped.

    SQUAREM on the posteriors: two EM steps, an extrapolation along them, one stabilising step. Plain EM from a
    weak start crawls for hundreds of steps.
    """
    q = _clamp(q, labels)
    gaps = _Gaps([np.zeros((q.shape[1], len(r), c.shape[1])) for r, c in rows.blocks],
                 [np.repeat(np.eye(c.shape[1])[None], len(r), axis=0) for r, c in rows.blocks], [], [])  # fmt: skip
    steps = 0
    while True:
        q1, gaps, _ = _em_step(rows, labels, q, gaps, cfg.ridge)
        q2, gaps, _ = _em_step(rows, labels, q1, gaps, cfg.ridge)
        r, v = q1 - q, q2 - 2 * q1 + q
        alpha = min(-math.sqrt(float(np.sum(r * r)) / max(float(np.sum(v * v)), 1e-300)), -1.0)
        jump = _clamp(_normalize(np.clip(q - 2 * alpha * r + alpha * alpha * v, 1e-9, 1.0)), labels)
        new, gaps, params = _em_step(rows, labels, jump, gaps, cfg.ridge)
        steps += 3
        done = float(np.abs(new[:, 0] - q[:, 0]).mean()) < cfg.tol  # how wrong mass splits does not matter
        q = new
        if done or steps >= max_iter:
            break
    return _Fit(params, q, steps, _prompt_prior_loglik(rows, groups, params, q, cfg.prompt_prior_strength))


def _em_step(
    rows: _Rows, labels: np.ndarray | None, q: np.ndarray, gaps: _Gaps, ridge: float
) -> tuple[np.ndarray, _Gaps, _Params]:
    """M-step then E-step: new posteriors, what the E-step found about missing scores, the params."""
    params = _m_step(rows, gaps, q, ridge)
    loglik, gaps = _class_loglik(rows, params)
    return _clamp(_softmax(np.log(params.shares) + loglik), labels), gaps, params


def _m_step(rows: _Rows, gaps: _Gaps, q: np.ndarray, ridge: float) -> _Params:
    """Class shares, means and the pooled within-class covariance, with missing scores at their conditional means.

    With x_nc the row completed for class c: sum_c sum_n q_nc x_nc x_nc^T = gram + (Z~^T E + E^T Z~) + sum_n
    sum_c q_nc f_nc f_nc^T, where E holds each row's posterior-averaged fill; then subtract sum_c n_c mu_c mu_c^T
    and add sum_n Cov[z_m | z_o].
    """
    n, v = rows.filled.shape
    counts = np.maximum(q.sum(axis=0), 1e-9)  # [K]
    sums = q.T @ rows.filled  # [K, V]
    second = rows.gram.copy()
    fill_avg = np.zeros_like(rows.filled)
    for (r, c), fills, cond in zip(rows.blocks, gaps.fills, gaps.cond, strict=True):
        qr = q[r]  # [R, K]
        for k in range(len(counts)):
            sums[k] += np.bincount(c.ravel(), weights=(qr[:, k : k + 1] * fills[k]).ravel(), minlength=v)
        fill_avg[r[:, None], c] = np.sum(qr.T[:, :, None] * fills, axis=0)
        outer = cond + sum(
            qr[:, j, None, None] * fills[j][:, :, None] * fills[j][:, None, :] for j in range(len(counts))
        )
        np.add.at(second, (c[:, :, None], c[:, None, :]), outer)
    cross = rows.filled.T @ fill_avg
    means = sums / counts[:, None]
    cov = second + cross + cross.T - (sums.T / counts) @ sums
    shares = np.clip(counts / n, 1e-4, 1.0)
    return _Params(shares / shares.sum(), means, cov / n + ridge * np.eye(v))


def _class_loglik(rows: _Rows, p: _Params) -> tuple[np.ndarray, _Gaps]:
    """[n, K] log N(z_o | mu_c,o, S_oo) without the parts equal for every class; and the gap statistics."""
    prec = np.linalg.inv(p.cov)
    pm = p.means @ prec  # [K, V]
    loglik = rows.filled @ pm.T - 0.5 * np.sum(pm * p.means, axis=1)  # exact for complete rows
    gaps = _Gaps([], [], [], [])
    for r, c in rows.blocks:
        correction, block = _gap_block(rows.filled[r], c, p.means, pm, prec)
        loglik[r] += correction
        for store, item in zip((gaps.fills, gaps.cond, gaps.quad, gaps.logdet), block, strict=True):
            store.append(item)
    return loglik, gaps


def _gap_block(
    zr: np.ndarray, c: np.ndarray, means: np.ndarray, pm: np.ndarray, prec: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Rows [R] missing columns c [R, k]: correction to z~^T P mu_c - mu_c^T P mu_c / 2, and the fill statistics."""
    pmm = prec[c[:, :, None], c[:, None, :]]  # [R, k, k]
    w = np.linalg.inv(pmm)
    a = np.take_along_axis(zr @ prec, c, axis=1)  # (P z~)_m, [R, k]
    mu_m, pm_m = means[:, c], pm[:, c]  # [K, R, k]
    p_mu = _batch_matvec(pmm, mu_m)  # P_mm mu_c,m
    b = pm_m - p_mu  # (P mu~_c)_m
    wa, wb = _batch_matvec(w, a[None])[0], _batch_matvec(w, b)
    # z_o^T S_oo^-1 mu_c,o = z~^T P mu~_c - a^T W b_c, and z~^T P mu~_c = z~^T P mu_c - mu_c,m . a
    linear = -np.sum(mu_m * a, axis=2) - np.sum(wb * a, axis=2)  # [K, R]
    # mu_c,o^T S_oo^-1 mu_c,o = mu_c^T P mu_c - 2 mu_c,m . (P mu_c)_m + mu_c,m^T P_mm mu_c,m - b_c^T W b_c
    quad = np.sum(mu_m * (p_mu - 2 * pm_m), axis=2) - np.sum(b * wb, axis=2)
    fills = mu_m - (wa[None] - wb)
    return (linear - 0.5 * quad).T, (fills, w, np.sum(a * wa, axis=1), np.linalg.slogdet(pmm)[1])


def _batch_matvec(m: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[R, k, k] matrices times [K, R, k] vectors -> [K, R, k]."""
    return np.matmul(m[None], x[..., None])[..., 0]


def _posterior(z: np.ndarray, p: _Params) -> np.ndarray:
    """[n, K] class posteriors for any rows, with the global class shares as prior."""
    rows = _Rows(z, np.nan_to_num(z), np.zeros((0, 0)), _missing_blocks(np.isnan(z)))
    return _softmax(np.log(p.shares) + _class_loglik(rows, p)[0])


def _prompt_prior_loglik(rows: _Rows, groups: np.ndarray, p: _Params, q: np.ndarray, strength: float) -> float:
    """Mean log p(z_o) when a candidate's class prior is its prompt's leave-one-out class shares (to the global)."""
    prior = np.stack([_leave_one_out(q[:, k], groups, p.shares[k], strength) for k in range(q.shape[1])], axis=1)
    return float(np.mean(_logsumexp(_marginal_loglik(rows, p) + np.log(prior))))


def _leave_one_out(x: np.ndarray, groups: np.ndarray, prior: float, strength: float) -> np.ndarray:
    """[n] mean of x over the other rows of the same prompt, with `strength` pseudo-rows at `prior`."""
    _, inverse = np.unique(groups, return_inverse=True)
    total, count = np.bincount(inverse, weights=x)[inverse], np.bincount(inverse)[inverse]
    return np.clip((total - x + strength * prior) / (count - 1 + strength), 1e-6, 1 - 1e-6)


def _count_correct(rows: _Rows, groups: np.ndarray, p: _Params, cfg: EnsembleConfig) -> _Params:
    """How many of the top classes are correct: the cut under which correctness clusters most by prompt.

    A middle class is either a convincing kind of wrong (a popular wrong answer: its candidates share prompts with
    other wrong ones) or a less convincing kind of right (its candidates share prompts with right ones). Each cut
    j is scored by the likelihood with a two-level prior: P(correct) from the prompt's other candidates
    (leave-one-out), split over the classes on each side of the cut by their global shares.
    """
    loglik = _marginal_loglik(rows, p)
    post = _softmax(np.log(p.shares) + loglik)
    scores = []
    for j in range(1, len(p.shares)):
        pi = float(p.shares[:j].sum())
        rho = _leave_one_out(post[:, :j].sum(axis=1), groups, pi, cfg.prompt_prior_strength)[:, None]
        prior = np.concatenate([rho * p.shares[:j] / pi, (1 - rho) * p.shares[j:] / (1 - pi)], axis=1)
        scores.append(float(np.mean(_logsumexp(loglik + np.log(prior)))))
    return _Params(p.shares, p.means, p.cov, 1 + int(np.argmax(scores)))


def _marginal_loglik(rows: _Rows, p: _Params) -> np.ndarray:
    """[n, K] log N(z_o | mu_c,o, S_oo) in full: the class part plus -(z_o^T S_oo^-1 z_o + log|S_oo|) / 2 - ..."""
    loglik, gaps = _class_loglik(rows, p)
    prec = np.linalg.inv(p.cov)
    own = np.sum((rows.filled @ prec) * rows.filled, axis=1) + np.linalg.slogdet(p.cov)[1]
    for (r, _), a_quad, logdet in zip(rows.blocks, gaps.quad, gaps.logdet, strict=True):
        own[r] += logdet - a_quad  # |S_oo| = |S| |P_mm|; z_o^T S_oo^-1 z_o = z~^T P z~ - a^T W a
    observed = (~np.isnan(rows.z)).sum(axis=1)
    return loglik - 0.5 * (own + observed * math.log(2 * math.pi))[:, None]


def _normalize(q: np.ndarray) -> np.ndarray:
    return q / q.sum(axis=1, keepdims=True)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=1)
    return top + np.log(np.exp(x - top[:, None]).sum(axis=1))


def _clamp(q: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """Labelled rows: a 1 is class 0, a 0 is spread over the wrong classes as the posterior has it."""
    if labels is None:
        return q
    q = q.copy()
    right, wrong = labels == 1, labels == 0
    q[right] = 0.0
    q[right, 0] = 1.0
    q[wrong, 0] = 0.0
    q[wrong, 1:] = np.where(q[wrong, 1:].sum(axis=1, keepdims=True) > 0, q[wrong, 1:], 1.0)
    q[wrong] = _normalize(q[wrong])
    return q


def _orient(p: _Params, threshold: float) -> _Params:
    """Order classes by how high verifiers score them: class 0 is "correct".

    The score is sum over v of mu_cv / sd_v, each verifier weighted 1 / (size of its dependent group), so five
    copies of one verifier still get one vote.
    """
    sd = np.sqrt(np.diag(p.cov))
    vote = np.ones(len(sd))
    for members in _average_linkage(p.cov / np.outer(sd, sd), threshold):
        vote[members] = 1.0 / len(members)
    order = np.argsort(-(p.means / sd) @ vote, kind="stable")
    return _Params(p.shares[order], p.means[order], p.cov, p.correct)


# ---------------------------------------------------------------- report


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _make_report(
    p: _Params, fit: _Fit, start: str, z: np.ndarray, groups: np.ndarray, names: list[str],
    labels: np.ndarray | None, cfg: EnsembleConfig,
) -> EnsembleReport:  # fmt: skip
    """What was estimated, in plain lists; quality and weights compare the correct classes with the wrong ones."""
    cov = p.cov - cfg.ridge * np.eye(len(p.cov))
    sd = np.sqrt(np.maximum(np.diag(cov), 1e-12))
    within = cov / np.outer(sd, sd)
    j = p.correct
    right = p.shares[:j] @ p.means[:j] / p.shares[:j].sum()  # [V] mean over the correct classes
    gap = right - p.shares[j:] @ p.means[j:] / p.shares[j:].sum()  # minus the mean over the wrong ones
    if start.startswith("verifier "):
        start = f"verifier {names[int(start.split()[1])]}"
    return EnsembleReport(
        class_balance=round(float(p.shares[:j].sum()), 4),
        class_shares=[round(float(x), 4) for x in p.shares],
        correct_classes=j,
        names=names,
        est_auroc=[round(_normal_cdf(float(g / s) / math.sqrt(2.0)), 4) for g, s in zip(gap, sd, strict=True)],
        weights=[round(float(w), 4) for w in np.linalg.solve(p.cov, gap)],
        missing_share=[round(float(x), 4) for x in np.isnan(z).mean(axis=0)],
        dependent_groups=[
            [names[i] for i in c] for c in _average_linkage(within, cfg.dependence_threshold) if len(c) > 1
        ],
        within_class_corr=[[round(float(x), 3) for x in row] for row in within],
        start=start,
        iterations=fit.iterations,
        n_candidates=len(groups),
        n_groups=len(np.unique(groups)),
        n_fit_rows=len(z),
        n_labels=0 if labels is None else int((~np.isnan(labels)).sum()),
    )
