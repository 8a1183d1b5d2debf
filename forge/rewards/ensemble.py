"""Label-free weak-verifier ensemble: P(candidate correct | the scores of V weak verifiers), fit without labels.

Shapes: N candidates (B prompts x G samples, flattened), V verifiers. `scores` is [N, V] with NaN where a
verifier gave no score; `groups` is [N] (prompt id).

What `fit` really does:
1. Normal scores. Each verifier's scores become the normal scores of their ranks (a tie block gets the mean of
   its slice of the standard normal), then unit variance. Only the order a verifier puts candidates in matters,
   so logits, probabilities, 1-10 grades and 0/1 checks mix freely. NaN stays NaN.
2. Correlations C [V, V] between verifiers over the candidates both scored (missing completely at random assumed).
3. One latent factor for correctness. If verifiers were independent given the label, C_ij = l_i l_j off the
   diagonal, where l_v = sqrt(pi (1 - pi)) * (class-mean gap of verifier v). The loadings l are initialised by the
   median over triplets of C_ij C_ik / C_jk (robust to a few dependent pairs), then fit by least squares to the
   pairs NOT flagged as dependent. Sign: the loadings sum to a positive number (verifiers are, on balance,
   better than chance); labels, when given, overrule this.
4. Dependent verifiers. The residual C - l l^T, rescaled to a within-class correlation, is clustered by average
   linkage: verifiers correlated above `dependence_threshold` beyond what correctness explains form a dependent
   group. Steps 3-4 repeat until the groups stop changing.
5. Weights. The within-class covariance S = C - l l^T is kept inside dependent groups and set to 0 across them
   (plus a ridge); a row's discriminant is t = l_o^T S_oo^-1 z_o over the verifiers o it has, so a missing score
   is marginalised out exactly under the Gaussian model and the row is never dropped. A verifier copied k times
   shares one weight k ways instead of being counted k times.
6. Class balance pi. Given l, t is normal within each class with a gap that depends on pi alone
   (gap = Q / sqrt(pi (1 - pi)), Q = l_o^T S_oo^-1 l_o), so pi is the maximum-likelihood value on a grid.
7. Output: posterior logit = log(pi / (1 - pi)) + (t - (1 - 2 pi) Q / (2 s)) / s with s = sqrt(pi (1 - pi)).
   Continuous, so candidates of one prompt rarely tie. With labels (optional, NaN = unknown) a 2-parameter
   logistic recalibration of that logit is fit, shrunk towards the identity.

Where this departs from Weaver (Saad-Falcon et al., 2025): no min-max + threshold binarisation (continuous normal
scores instead, so rewards do not tie); the class balance is estimated, not set from labels; no drop rule (a
useless verifier gets a loading near 0 and so a weight near 0, an adversarial one a negative weight); the model is
Gaussian class-conditional (LDA) rather than a binary Snorkel label model, fit in closed form from moments plus a
1-D likelihood instead of an iterative optimiser that may stop early; and verifiers are not assumed independent:
dependent groups are detected and their within-class covariance is modelled. `groups` is only validated and used
in the report: rankings are per candidate; selection within a prompt is the caller's argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from forge.errors import UserError


@dataclass(frozen=True)
class EnsembleConfig:
    dependence_threshold: float = 0.2
    """Within-class correlation above which two verifiers (or dependent groups, on average) are merged."""
    ridge: float = 0.05
    """Added to the within-class covariance diagonal (unit-variance scores): near-duplicates split a weight."""
    min_loading: float = 0.02
    """Loadings below this in absolute value are treated as 0 (the verifier carries no usable signal)."""
    max_rounds: int = 6
    """Rounds of (fit loadings, find dependent groups) before giving up on the groups changing."""
    max_knots: int = 2048
    """Score-to-normal-score knots kept per verifier for scoring new candidates."""
    label_prior: float = 20.0
    """Labels only: pseudo-count pulling the recalibration (slope 1, offset 0) towards the label-free fit."""


@dataclass(frozen=True)
class EnsembleReport:
    class_balance: float  # estimated share of correct candidates
    names: list[str]  # [V]
    loadings: list[float]  # [V] correlation of each verifier's normal score with the latent label
    weights: list[float]  # [V] discriminant weight on each verifier's normal score (all rows observed)
    est_auroc: list[float]  # [V] model-implied AUROC of each verifier alone
    missing_share: list[float]  # [V] share of candidates the verifier did not score
    dependent_groups: list[list[str]]  # verifiers whose errors are correlated beyond what correctness explains
    within_class_corr: list[list[float]]  # [V, V] residual correlation after removing the latent label
    n_candidates: int
    n_groups: int
    n_labels: int  # labels used for recalibration (0 = label-free)
    calibration: tuple[float, float]  # (slope, offset) applied to the label-free logit


@dataclass(frozen=True)
class _Transform:
    knots_x: list[np.ndarray]  # per verifier: sorted raw scores
    knots_z: list[np.ndarray]  # per verifier: their unit-variance normal scores


@dataclass(frozen=True)
class _Model:
    loadings: np.ndarray  # [V]
    cov: np.ndarray  # [V, V] within-class covariance, zero across dependent groups, ridge included
    clusters: list[np.ndarray]  # verifier indices per dependent group (singletons included)
    pi: float
    calibration: tuple[float, float]


class WeakVerifierEnsemble:
    """Fit on unlabeled verifier scores; predict P(correct). See the module docstring for the method."""

    def __init__(self, config: EnsembleConfig | None = None) -> None:
        self.config = config or EnsembleConfig()
        self._transform: _Transform | None = None
        self._model: _Model | None = None
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
        cfg = self.config
        self._transform = _fit_transform(scores, cfg.max_knots)
        z = _apply_transform(self._transform, scores)  # [N, V]
        corr = _pairwise_corr(z)
        loadings, clusters = _factor_with_dependence(corr, cfg)
        known = _check_labels(labels, len(z))
        if known is not None and _label_disagrees(z, loadings, known):
            loadings = -loadings
        cov = _within_cov(corr, loadings, clusters, cfg.ridge)
        t, q = _discriminant(z, loadings, cov, clusters)
        pi = _fit_balance(t, q)
        calibration = (1.0, 0.0) if known is None else _recalibrate(_logit(t, q, pi), known, cfg.label_prior)
        self._model = _Model(loadings, cov, clusters, pi, calibration)
        self._report = _make_report(self._model, corr, z, groups, names, known)
        return self

    def predict_proba(self, scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """[N] probability that each candidate is correct."""
        if self._model is None or self._transform is None:
            raise UserError("WeakVerifierEnsemble.predict_proba: call fit(scores, groups) first")
        scores, groups = _check_inputs(scores, groups, n_verifiers=len(self._model.loadings))
        m = self._model
        t, q = _discriminant(_apply_transform(self._transform, scores), m.loadings, m.cov, m.clusters)
        slope, offset = m.calibration
        return _sigmoid(slope * _logit(t, q, m.pi) + offset)

    def report(self) -> dict:
        """Estimated class balance, per-verifier quality and weights, dependent groups (plain JSON-able dict)."""
        if self._report is None:
            raise UserError("WeakVerifierEnsemble.report: call fit(scores, groups) first")
        return asdict(self._report)


# ---------------------------------------------------------------- inputs


def _check_inputs(
    scores: np.ndarray, groups: np.ndarray, n_verifiers: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64)
    groups = np.asarray(groups)
    if scores.ndim != 2 or scores.shape[0] < 2:
        raise UserError(f"ensemble: scores must be a [N, V] array with N >= 2, got shape {scores.shape}")
    if n_verifiers is not None and scores.shape[1] != n_verifiers:
        raise UserError(f"ensemble: fit saw {n_verifiers} verifiers but scores has {scores.shape[1]} columns")
    if groups.shape != (scores.shape[0],):
        raise UserError(f"ensemble: groups must have one prompt id per row ({scores.shape[0]}), got {groups.shape}")
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
        raise UserError(f"ensemble: labels must have one entry per row ({n}), NaN = unknown; got {labels.shape}")
    seen = labels[~np.isnan(labels)]
    if not np.isin(seen, (0.0, 1.0)).all():
        raise UserError("ensemble: labels must be 0, 1 or NaN (unknown)")
    return labels if len(seen) else None


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
    r = q * q
    x_mid = np.polyval(a, r) * q / (np.polyval(b, r) * r + 1.0)
    low = 0.02425
    return np.where(p < low, x_tail, np.where(p > 1 - low, -x_tail, x_mid))


def _normal_pdf_at_quantile(f: np.ndarray) -> np.ndarray:
    """phi(Phi^-1(f)), 0 at f = 0 and f = 1."""
    inside = (f > 0) & (f < 1)
    x = _ndtri(np.where(inside, f, 0.5))
    return np.where(inside, np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi), 0.0)


def _column_knots(col: np.ndarray, max_knots: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct scores and their normal scores: E[Z | Z in the slice of N(0,1) the tie block covers]."""
    values, counts = np.unique(col[~np.isnan(col)], return_counts=True)
    if len(values) == 0:
        return np.zeros(1), np.zeros(1)
    hi = np.cumsum(counts) / counts.sum()
    lo = hi - counts / counts.sum()
    z = (_normal_pdf_at_quantile(lo) - _normal_pdf_at_quantile(hi)) / (hi - lo)
    sd = math.sqrt(float(np.sum(counts * z * z) / counts.sum()))
    z = z / sd if sd > 1e-12 else np.zeros_like(z)
    if len(values) > max_knots:  # keep every big tie block exactly, thin the continuous part
        keep = counts > counts.sum() / max_knots
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


def _pairwise_corr(z: np.ndarray) -> np.ndarray:
    """[V, V] mean product of unit-variance normal scores over rows where both are present."""
    observed = (~np.isnan(z)).astype(np.float64)
    filled = np.nan_to_num(z)
    counts = observed.T @ observed
    corr = (filled.T @ filled) / np.maximum(counts, 1.0)
    corr[counts < 3] = 0.0  # pairs never scored together carry no evidence
    np.fill_diagonal(corr, 1.0)
    return corr


# ---------------------------------------------------------------- latent factor and dependence


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
            mags[i] = math.sqrt(max(float(np.median((cj * ck / cjk)[usable])), 0.0))
    return mags * _factor_signs(corr)


def _factor_signs(corr: np.ndarray) -> np.ndarray:
    off = corr - np.diag(np.diag(corr))
    _, vecs = np.linalg.eigh(off)
    lead = vecs[:, -1]
    return np.where(lead >= 0, 1.0, -1.0) * (1.0 if lead.sum() >= 0 else -1.0)


def _rank_one_fit(corr: np.ndarray, allowed: np.ndarray, init: np.ndarray, iters: int = 300) -> np.ndarray:
    """Least-squares l with C_ij ~ l_i l_j over allowed off-diagonal pairs (damped coordinate updates)."""
    lam = init.copy()
    weights = allowed.astype(np.float64)
    np.fill_diagonal(weights, 0.0)
    for _ in range(iters):
        den = weights @ (lam * lam)
        new = np.where(den > 1e-12, (weights * corr) @ lam / np.maximum(den, 1e-12), 0.0)
        new = np.clip(new, -0.999, 0.999)
        if np.max(np.abs(new - lam)) < 1e-7:
            return new
        lam = 0.5 * lam + 0.5 * new
    return lam


def _within_corr(corr: np.ndarray, loadings: np.ndarray) -> np.ndarray:
    resid_var = np.maximum(1.0 - loadings**2, 1e-3)
    within = (corr - np.outer(loadings, loadings)) / np.sqrt(np.outer(resid_var, resid_var))
    np.fill_diagonal(within, 1.0)
    return within


def _average_linkage(within: np.ndarray, threshold: float) -> list[np.ndarray]:
    """Merge the two clusters of highest mean within-class correlation while it exceeds the threshold."""
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
        a, b = pair
        clusters[a] = clusters[a] + clusters.pop(b)
    return [np.array(sorted(c)) for c in sorted(clusters, key=min)]


def _factor_with_dependence(corr: np.ndarray, cfg: EnsembleConfig) -> tuple[np.ndarray, list[np.ndarray]]:
    loadings = _triplet_loadings(corr)
    clusters: list[np.ndarray] = [np.array([i]) for i in range(len(corr))]
    for _ in range(cfg.max_rounds):
        new_clusters = _average_linkage(_within_corr(corr, loadings), cfg.dependence_threshold)
        allowed = _cross_cluster_mask(new_clusters, len(corr))
        loadings = _rank_one_fit(corr, allowed, loadings)
        if _same_clusters(new_clusters, clusters):
            break
        clusters = new_clusters
    loadings = np.where(np.abs(loadings) < cfg.min_loading, 0.0, loadings)
    return (loadings if loadings.sum() >= 0 else -loadings), clusters


def _cross_cluster_mask(clusters: list[np.ndarray], v: int) -> np.ndarray:
    label = np.empty(v, dtype=int)
    for k, members in enumerate(clusters):
        label[members] = k
    return label[:, None] != label[None, :]


def _same_clusters(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- discriminant, balance, posterior


def _within_cov(corr: np.ndarray, loadings: np.ndarray, clusters: list[np.ndarray], ridge: float) -> np.ndarray:
    full = corr - np.outer(loadings, loadings)
    cov = np.zeros_like(corr)
    for members in clusters:
        cov[np.ix_(members, members)] = full[np.ix_(members, members)]
    idx = np.arange(len(corr))
    cov[idx, idx] = np.maximum(cov[idx, idx], 0.05) + ridge
    return cov


def _discriminant(
    z: np.ndarray, loadings: np.ndarray, cov: np.ndarray, clusters: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """t = sum over groups of l_o^T S_oo^-1 z_o and Q = sum of l_o^T S_oo^-1 l_o, per row's observed set o."""
    t = np.zeros(len(z))
    q = np.zeros(len(z))
    for members in clusters:
        zc = z[:, members]  # [N, k]
        observed = ~np.isnan(zc)
        codes = observed @ (1 << np.arange(len(members), dtype=np.int64)) if len(members) < 62 else None
        patterns, inverse = _patterns(observed, codes)
        w = np.zeros((len(patterns), len(members)))
        qp = np.zeros(len(patterns))
        for p, pat in enumerate(patterns):
            o = np.flatnonzero(pat)
            if len(o):
                w[p, o] = np.linalg.solve(cov[np.ix_(members[o], members[o])], loadings[members[o]])
                qp[p] = float(w[p, o] @ loadings[members[o]])
        t += np.sum(w[inverse] * np.nan_to_num(zc), axis=1)
        q += qp[inverse]
    return t, q


def _patterns(observed: np.ndarray, codes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    if codes is None:
        return np.unique(observed, axis=0, return_inverse=True)
    uniq, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    return observed[first], inverse


def _fit_balance(t: np.ndarray, q: np.ndarray) -> float:
    """Maximum-likelihood pi for t | y ~ N(mean_y(pi) * Q, Q) with mean_1 = (1-pi)/s, mean_0 = -pi/s."""
    grid = np.linspace(0.01, 0.99, 197)
    informative = q > 1e-9
    t, q = t[informative], q[informative]
    if len(t) == 0:
        return 0.5
    lls = [_balance_loglik(t, q, pi) for pi in grid]
    return float(grid[int(np.argmax(lls))])


def _balance_loglik(t: np.ndarray, q: np.ndarray, pi: float) -> float:
    s = math.sqrt(pi * (1 - pi))
    a1 = -0.5 * (t - (1 - pi) * q / s) ** 2 / q + math.log(pi)
    a0 = -0.5 * (t + pi * q / s) ** 2 / q + math.log(1 - pi)
    return float(np.sum(np.logaddexp(a0, a1)))


def _logit(t: np.ndarray, q: np.ndarray, pi: float) -> np.ndarray:
    s = math.sqrt(pi * (1 - pi))
    return math.log(pi / (1 - pi)) + (t - (1 - 2 * pi) * q / (2 * s)) / s


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# ---------------------------------------------------------------- labels (optional)


def _label_disagrees(z: np.ndarray, loadings: np.ndarray, labels: np.ndarray) -> bool:
    """True when the labelled rows say the latent factor is upside down (wrong sign)."""
    known = ~np.isnan(labels)
    s = np.nan_to_num(z[known]) @ loadings
    y = labels[known]
    if y.min() == y.max():
        return False
    return float(s[y == 1].mean()) < float(s[y == 0].mean())


def _recalibrate(logit: np.ndarray, labels: np.ndarray, prior: float) -> tuple[float, float]:
    """Logistic fit of labels on (slope * logit + offset), Newton steps, Gaussian prior at (1, 0)."""
    known = ~np.isnan(labels)
    x, y = logit[known], labels[known]
    theta = np.array([1.0, 0.0])
    design = np.stack([x, np.ones_like(x)], axis=1)
    for _ in range(25):
        p = _sigmoid(design @ theta)
        grad = design.T @ (p - y) + prior * (theta - np.array([1.0, 0.0]))
        hess = design.T @ (design * (p * (1 - p))[:, None]) + prior * np.eye(2)
        theta = theta - np.linalg.solve(hess, grad)
    return float(theta[0]), float(theta[1])


# ---------------------------------------------------------------- report


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _make_report(
    m: _Model, corr: np.ndarray, z: np.ndarray, groups: np.ndarray, names: list[str], labels: np.ndarray | None
) -> EnsembleReport:
    s = math.sqrt(m.pi * (1 - m.pi))
    resid = np.maximum(1.0 - m.loadings**2, 1e-6)
    auroc = [_normal_cdf(float(lv) / s / math.sqrt(2 * r)) for lv, r in zip(m.loadings, resid, strict=True)]
    weights = np.zeros(len(m.loadings))
    for members in m.clusters:
        weights[members] = np.linalg.solve(m.cov[np.ix_(members, members)], m.loadings[members])
    within = _within_corr(corr, m.loadings)
    return EnsembleReport(
        class_balance=m.pi,
        names=names,
        loadings=[round(float(x), 4) for x in m.loadings],
        weights=[round(float(x), 4) for x in weights],
        est_auroc=[round(a, 4) for a in auroc],
        missing_share=[round(float(x), 4) for x in np.isnan(z).mean(axis=0)],
        dependent_groups=[[names[i] for i in c] for c in m.clusters if len(c) > 1],
        within_class_corr=[[round(float(x), 3) for x in row] for row in within],
        n_candidates=len(z),
        n_groups=len(np.unique(groups)),
        n_labels=0 if labels is None else int((~np.isnan(labels)).sum()),
        calibration=m.calibration,
    )
