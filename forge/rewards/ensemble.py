"""Label-free weak-verifier ensemble: P(candidate correct | the scores of V weak verifiers), fit without labels.

Shapes: N candidates (B prompts x G samples, flattened), V verifiers. `scores` is [N, V] with NaN where a verifier
gave no score; `groups` is [N] (prompt id). Labels are optional and never needed.

The model: a two-class Gaussian mixture with one full within-class covariance (unsupervised LDA), on normal scores.

1. Normal scores. Each verifier's scores are replaced by normal scores of their ranks, so only the order a verifier
   puts candidates in matters: logits, probabilities, 1-10 grades and 0/1 checks mix freely. For fitting, a tie
   block (all the 0s of a 0/1 check) is spread over its slice of N(0, 1) by a draw seeded from the column's bytes
   (identical columns get identical draws); otherwise a big tie block looks like a cluster the mixture latches
   onto. For prediction a tie block gets the mean of its slice, which for this model gives the expected logit.
2. Mixture by EM: class balance pi, class means mu_1, mu_0 [V], one within-class covariance S [V, V] (plus a
   ridge). S holds whatever correlates verifiers beyond correctness -- shared length bias, a family of reward
   models from one base model, duplicates -- so the discriminant S^-1 (mu_1 - mu_0) discounts it; an exact copy
   splits its verifier's weight instead of adding to it. Missing scores are integrated out exactly: the E-step
   fills them with their conditional mean given the row's observed scores (per class) and adds the conditional
   covariance to the M-step, so a candidate is never dropped and the posterior uses only what was observed.
3. Starts and choice. The mixture likelihood has several optima (a length factor, a popular wrong answer). EM
   runs from three starts: a one-factor moment fit (loadings from the median of triplet ratios C_ij C_ik / C_jk,
   refit without pairs flagged as dependent: the agreement-based initialisation of Snorkel/FlyingSquid), the same
   on per-prompt mean scores (prompt difficulty is shared by all verifiers, length and reward-model quirks mostly
   are not), and the plain mean of normal scores. It keeps the optimum with the highest likelihood under a
   leave-one-out per-prompt prior (a candidate's prior is the posterior share of correct among the other
   candidates of its prompt, shrunk to pi): correctness clusters by prompt, nuisance factors do not.
4. Orientation: the class that most verifiers score higher (sum over v of (mu_1 - mu_0)_v / sd_v > 0) is
   "correct"; labelled rows, when given, are clamped to their label in every E-step instead.
5. Output: sigmoid(log(pi / (1 - pi)) + LDA log-likelihood ratio): continuous, so candidates of a prompt rarely
   tie. The per-prompt prior is used only to choose between starts, not in the output, so a candidate's reward
   does not depend on the other candidates' scores.

Speed: the normal-score transform uses every row; EM runs on at most `max_fit_rows` rows (whole prompts drawn
with a fixed seed), which estimates V means and a V x V covariance well for V up to a few dozen.

Where this departs from Weaver (Saad-Falcon et al., 2025): no min-max + threshold binarisation (normal scores, so
rewards do not tie); the class balance is estimated, not set from labels; no drop rule (a useless verifier gets a
weight near 0, an adversarial one a negative weight); a Gaussian mixture fit by EM to convergence instead of a
binary Snorkel label model fit by moment matching; and verifiers are not assumed conditionally independent: their
within-class covariance is estimated and used (`report()["dependent_groups"]` lists the strongly dependent ones).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from forge.errors import UserError


@dataclass(frozen=True)
class EnsembleConfig:
    ridge: float = 0.05
    """Added to the within-class covariance diagonal (unit-variance scores): near-duplicates share a weight."""
    max_iter: int = 100
    """EM iterations at most, per finalist and for the final fit."""
    tol: float = 1e-4
    """EM stops when the mean change of the posteriors is below this."""
    max_fit_rows: int = 20_000
    """The final EM runs on at most this many rows (whole prompts, fixed seed); the score transform uses all rows."""
    screen_rows: int = 4_000
    """Starts are screened and the finalists run to convergence on at most this many rows (whole prompts)."""
    screen_iter: int = 15
    """EM iterations each start gets before the screen keeps the best `finalists`."""
    finalists: int = 3
    """Starts run to convergence after the screen; the best by score is refit on the fit rows."""
    prompt_prior_strength: float = 2.0
    """Pseudo-count pulling a prompt's leave-one-out share of correct candidates towards pi (start choice only)."""
    dependence_threshold: float = 0.2
    """Within-class correlation above which verifiers count as dependent (moment start and the report)."""
    max_knots: int = 2048
    """Score-to-normal-score knots kept per verifier for scoring new candidates."""
    seed: int = 0
    """Seed for the tie-spreading draws and the choice of fit rows; fit is deterministic given it."""


@dataclass(frozen=True)
class EnsembleReport:
    class_balance: float  # estimated share of correct candidates
    names: list[str]  # [V]
    est_auroc: list[float]  # [V] model-implied AUROC of each verifier alone (< 0.5: it scores wrong answers higher)
    weights: list[float]  # [V] discriminant weight on each verifier's normal score
    missing_share: list[float]  # [V] share of candidates the verifier did not score
    dependent_groups: list[list[str]]  # verifiers correlated beyond what correctness explains (average linkage)
    within_class_corr: list[list[float]]  # [V, V] correlation between verifiers within a class
    start: str  # which start won: "moments", "prompt-means" or "mean"
    iterations: int  # EM iterations of the winning start
    n_candidates: int
    n_groups: int
    n_fit_rows: int  # rows EM ran on
    n_labels: int  # labelled rows clamped during EM (0 = label-free)


@dataclass(frozen=True)
class _Transform:
    knots_x: list[np.ndarray]  # per verifier: sorted distinct raw scores (thinned when continuous)
    knots_z: list[np.ndarray]  # per verifier: mean normal score of each one's slice


@dataclass(frozen=True)
class _Params:
    pi: float
    mu1: np.ndarray  # [V] mean normal score of correct candidates
    mu0: np.ndarray  # [V] mean normal score of wrong candidates
    cov: np.ndarray  # [V, V] within-class covariance, ridge included


@dataclass(frozen=True)
class _Fit:
    params: _Params
    q: np.ndarray  # [n_fit] posteriors on the fit rows
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
        q = _clamp(_sigmoid(math.log(params.pi / (1 - params.pi)) + _log_ratio(z, params)), y)
        fit = _em(_Rows.of(z), g, y, q, cfg, cfg.max_iter)
        self._params = _orient(fit.params) if y is None else fit.params
        self._report = _make_report(self._params, fit, start, z, groups, names, y, cfg)
        return self

    def predict_proba(self, scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """[N] probability that each candidate is correct."""
        if self._params is None or self._transform is None:
            raise UserError("WeakVerifierEnsemble.predict_proba: call fit(scores, groups) first")
        scores, groups = _check_inputs(scores, groups, n_verifiers=len(self._params.mu1))
        p = self._params
        return _sigmoid(math.log(p.pi / (1 - p.pi)) + _log_ratio(_apply_transform(self._transform, scores), p))

    def report(self) -> dict:
        """Estimated class balance, per-verifier quality and weights, dependent groups (a JSON-able dict)."""
        if self._report is None:
            raise UserError("WeakVerifierEnsemble.report: call fit(scores, groups) first")
        return asdict(self._report)


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


def _choose_start(z: np.ndarray, groups: np.ndarray, labels: np.ndarray | None, cfg: EnsembleConfig):
    """Screen every start briefly on a few prompts, run the best few to convergence, return the best (by score)."""
    keep = _subsample(groups, cfg.screen_rows, cfg.seed + 1)
    zs, gs, ys = z[keep], groups[keep], None if labels is None else labels[keep]
    rows = _Rows.of(zs)
    short = {name: _em(rows, gs, ys, q0, cfg, cfg.screen_iter) for name, q0 in _starts(zs, gs, cfg).items()}
    finalists = sorted(short, key=lambda k: short[k].score, reverse=True)[: cfg.finalists]
    long = {name: _em(rows, gs, ys, short[name].q, cfg, cfg.max_iter) for name in finalists}
    best = max(long, key=lambda k: long[k].score)
    return best, long[best].params


def _starts(z: np.ndarray, groups: np.ndarray, cfg: EnsembleConfig) -> dict[str, np.ndarray]:
    """Initial posteriors [n]: moment loadings, the same on prompt means, the plain mean, each distinct verifier."""
    filled = np.nan_to_num(z)
    by_prompt = _prompt_means(z, groups)
    starts = {
        "moments": _soft_split(filled @ _moment_weights(_pairwise_corr(z), cfg.dependence_threshold)),
        "prompt-means": _soft_split(filled @ _moment_weights(_pairwise_corr(by_prompt), cfg.dependence_threshold)),
        "mean": _soft_split(np.nanmean(np.where(np.isnan(z), 0.0, z), axis=1)),
    }
    seen: set[bytes] = set()
    for v in range(z.shape[1]):  # the mixture is symmetric in its two classes, so a verifier's sign is irrelevant
        key = filled[:, v].tobytes()
        if key not in seen:
            seen.add(key)
            starts[f"verifier {v}"] = _soft_split(filled[:, v])
    return starts


def _prompt_means(z: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[n_prompts, V] mean normal score per prompt over the candidates a verifier scored (NaN if none)."""
    _, inverse = np.unique(groups, return_inverse=True)
    observed = ~np.isnan(z)
    sums = np.stack([np.bincount(inverse, weights=np.where(observed[:, v], z[:, v], 0.0)) for v in range(z.shape[1])])
    counts = np.stack([np.bincount(inverse, weights=observed[:, v]) for v in range(z.shape[1])])
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums / counts).T


def _soft_split(s: np.ndarray) -> np.ndarray:
    sd = float(s.std())
    return _sigmoid(2.0 * (s - s.mean()) / sd) if sd > 1e-12 else np.full(len(s), 0.5)


def _moment_weights(corr: np.ndarray, threshold: float) -> np.ndarray:
    """Naive-Bayes weights l / (1 - l^2) from one-factor loadings, shared out within dependent groups."""
    loadings, clusters = _factor_with_dependence(corr, threshold)
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
    label = np.empty(v, dtype=int)
    for k, members in enumerate(clusters):
        label[members] = k
    return label[:, None] != label[None, :]


# ---------------------------------------------------------------- EM with missing scores


@dataclass(frozen=True)
class _Rows:
    """Fit rows split once: complete rows enter EM through fixed sums, rows with gaps through exact conditionals."""

    z: np.ndarray  # [n, V] normal scores, NaN = missing
    complete: np.ndarray  # [n] bool
    full: np.ndarray  # [c, V] the complete rows
    gram: np.ndarray  # [V, V] sum of z z^T over complete rows
    gaps: np.ndarray  # [m, V] rows with at least one missing score
    missing: np.ndarray  # [m, V] bool
    blocks: list  # (rows of gaps, their missing columns [R, k]) per number k of missing entries

    @staticmethod
    def of(z: np.ndarray) -> _Rows:
        complete = ~np.isnan(z).any(axis=1)
        full, gaps = z[complete], z[~complete]
        missing = np.isnan(gaps)
        return _Rows(z, complete, full, full.T @ full, gaps, missing, _missing_blocks(missing))


def _em(
    rows: _Rows, groups: np.ndarray, labels: np.ndarray | None, q: np.ndarray, cfg: EnsembleConfig, max_iter: int
) -> _Fit:
    """Two-class tied-covariance Gaussian mixture from posteriors q; labelled rows (if any) stay clamped."""
    q = _clamp(q, labels)
    fills = (np.where(rows.missing, 0.0, rows.gaps),) * 2  # missing entries start at the mean (0)
    extra = np.diag(rows.missing.sum(axis=0).astype(np.float64))  # and with unit conditional variance
    it = 0
    for it in range(1, max_iter + 1):
        params = _m_step(rows, fills, extra, q, cfg.ridge)
        lr, fills, extra = _e_step(rows, params)
        new = _clamp(_sigmoid(math.log(params.pi / (1 - params.pi)) + lr), labels)
        done = float(np.abs(new - q).mean()) < cfg.tol
        q = new
        if done:
            break
    score = _prompt_prior_loglik(rows, groups, params, q, cfg.prompt_prior_strength)
    return _Fit(params, q, it, score)


def _clamp(q: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    return q if labels is None else np.where(np.isnan(labels), q, labels)


def _m_step(rows: _Rows, fills: tuple, extra: np.ndarray, q: np.ndarray, ridge: float) -> _Params:
    """Weighted class means and pooled covariance; fills hold each class's conditional mean for missing entries."""
    zc, qc, qg = rows.full, q[rows.complete], q[~rows.complete]
    s1 = qc @ zc + qg @ fills[0]
    s0 = (1 - qc) @ zc + (1 - qg) @ fills[1]
    n1, n0 = max(float(q.sum()), 1e-6), max(float((1 - q).sum()), 1e-6)
    mu1, mu0 = s1 / n1, s0 / n0
    # over complete rows: sum_y sum_n w_y (z - mu_y)(z - mu_y)^T = gram - n_y mu_y mu_y^T per class
    n1c, n0c = float(qc.sum()), float((1 - qc).sum())
    s1c, s0c = s1 - qg @ fills[0], s0 - (1 - qg) @ fills[1]
    cov = rows.gram - _sym(mu1, s1c, n1c) - _sym(mu0, s0c, n0c)
    d1, d0 = fills[0] - mu1, fills[1] - mu0
    cov += d1.T @ (d1 * qg[:, None]) + d0.T @ (d0 * (1 - qg)[:, None]) + extra
    v = len(mu1)
    return _Params(float(np.clip(n1 / len(q), 1e-3, 1 - 1e-3)), mu1, mu0, cov / len(q) + ridge * np.eye(v))


def _sym(mu: np.ndarray, s: np.ndarray, n: float) -> np.ndarray:
    """mu s^T + s mu^T - n mu mu^T: what centring a class's complete rows on mu removes from their gram matrix."""
    return np.outer(mu, s) + np.outer(s, mu) - n * np.outer(mu, mu)


def _e_step(rows: _Rows, p: _Params) -> tuple[np.ndarray, tuple, np.ndarray]:
    """Log-likelihood ratio per row, conditional-mean fills per class, summed conditional covariance [V, V]."""
    prec = np.linalg.inv(p.cov)
    lr = np.empty(len(rows.z))
    lr[rows.complete] = _linear_ratio(rows.full, p, prec)
    lr[~rows.complete], fills, extra = _gap_ratio(rows.gaps, rows.missing, rows.blocks, p, prec)
    return lr, fills, extra


def _linear_ratio(z: np.ndarray, p: _Params, prec: np.ndarray) -> np.ndarray:
    """Rows with every score: the LDA log-likelihood ratio, linear in z."""
    w = prec @ (p.mu1 - p.mu0)
    return (z - 0.5 * (p.mu1 + p.mu0)) @ w


def _gap_ratio(
    z: np.ndarray, missing: np.ndarray, blocks: list, p: _Params, prec: np.ndarray
) -> tuple[np.ndarray, tuple, np.ndarray]:
    """Rows with gaps: log N(z_o | mu1_o, S_oo) - log N(z_o | mu0_o, S_oo), via each class's conditional fill."""
    cond = [np.linalg.inv(prec[cols[:, :, None], cols[:, None, :]]) for _, cols in blocks]  # [R, k, k] each
    z1, z0 = (_fill_missing(z, missing, blocks, cond, mu, prec) for mu in (p.mu1, p.mu0))
    extra = np.zeros_like(prec)
    for (_, cols), c in zip(blocks, cond, strict=True):
        np.add.at(extra, (cols[:, :, None], cols[:, None, :]), c)
    d1, d0 = z1 - p.mu1, z0 - p.mu0
    # the fill's own density term, log N(z_m | E[z_m | z_o], S_m|o), is the same for both classes and cancels
    lr = -0.5 * (np.sum((d1 @ prec) * d1, axis=1) - np.sum((d0 @ prec) * d0, axis=1))
    return lr, (z1, z0), extra


def _log_ratio(z: np.ndarray, p: _Params) -> np.ndarray:
    """Log-likelihood ratio for any rows (prediction)."""
    prec = np.linalg.inv(p.cov)
    gaps = np.isnan(z).any(axis=1)
    lr = np.empty(len(z))
    lr[~gaps] = _linear_ratio(z[~gaps], p, prec)
    if gaps.any():
        missing = np.isnan(z[gaps])
        lr[gaps] = _gap_ratio(z[gaps], missing, _missing_blocks(missing), p, prec)[0]
    return lr


def _missing_blocks(missing: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, their missing columns [R, k]) per number k of missing entries."""
    n_missing = missing.sum(axis=1)
    blocks = []
    for k in np.unique(n_missing[n_missing > 0]):
        rows = np.flatnonzero(n_missing == k)
        blocks.append((rows, np.argsort(~missing[rows], axis=1, kind="stable")[:, :k]))
    return blocks


def _fill_missing(
    z: np.ndarray, missing: np.ndarray, blocks: list, cond: list, mu: np.ndarray, prec: np.ndarray
) -> np.ndarray:
    """Missing entries -> E[z_m | z_o] = mu_m - P_mm^-1 P_mo (z_o - mu_o) under N(mu, P^-1); cond[i] = P_mm^-1."""
    filled = np.where(missing, mu, z)
    pull = np.where(missing, 0.0, z - mu) @ prec  # column m of row r: (P_mo (z_o - mu_o))_m when m is missing
    for (rows, cols), inv_pmm in zip(blocks, cond, strict=True):
        shift = -np.einsum("rij,rj->ri", inv_pmm, np.take_along_axis(pull[rows], cols, axis=1))
        filled[rows[:, None], cols] = mu[cols] + shift
    return filled


def _prompt_prior_loglik(rows: _Rows, groups: np.ndarray, p: _Params, q: np.ndarray, strength: float) -> float:
    """Mean log p(z_o) when each candidate's prior is its prompt's leave-one-out share of correct (to pi)."""
    _, inverse = np.unique(groups, return_inverse=True)
    total, count = np.bincount(inverse, weights=q)[inverse], np.bincount(inverse)[inverse]
    prior = np.clip((total - q + strength * p.pi) / (count - 1 + strength), 1e-4, 1 - 1e-4)
    ll1, ll0 = (_marginal_loglik(rows, mu, p.cov) for mu in (p.mu1, p.mu0))
    return float(np.mean(np.logaddexp(ll1 + np.log(prior), ll0 + np.log1p(-prior))))


def _marginal_loglik(rows: _Rows, mu: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """log N(z_o | mu_o, S_oo) per row = log N(fill | mu, S) minus the fill's density under z_m | z_o."""
    prec = np.linalg.inv(cov)
    z = rows.z.copy()
    cond = [np.linalg.inv(prec[cols[:, :, None], cols[:, None, :]]) for _, cols in rows.blocks]
    z[~rows.complete] = _fill_missing(rows.gaps, rows.missing, rows.blocks, cond, mu, prec)
    d = z - mu
    ll = -0.5 * np.sum((d @ prec) * d, axis=1) - 0.5 * np.linalg.slogdet(cov)[1]
    gap_ll = ll[~rows.complete]
    for (r, _), c in zip(rows.blocks, cond, strict=True):
        gap_ll[r] += 0.5 * np.linalg.slogdet(c)[1]
    ll[~rows.complete] = gap_ll
    return ll - 0.5 * (~np.isnan(rows.z)).sum(axis=1) * math.log(2 * math.pi)


def _orient(p: _Params) -> _Params:
    """Call "correct" the class that most verifiers score higher (in units of their within-class sd)."""
    if float(np.sum((p.mu1 - p.mu0) / np.sqrt(np.diag(p.cov)))) >= 0:
        return p
    return _Params(1 - p.pi, p.mu0, p.mu1, p.cov)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# ---------------------------------------------------------------- report


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _make_report(
    p: _Params, fit: _Fit, start: str, z: np.ndarray, groups: np.ndarray, names: list[str],
    labels: np.ndarray | None, cfg: EnsembleConfig,
) -> EnsembleReport:  # fmt: skip
    cov = p.cov - cfg.ridge * np.eye(len(p.cov))
    sd = np.sqrt(np.maximum(np.diag(cov), 1e-12))
    within = cov / np.outer(sd, sd)
    gap = p.mu1 - p.mu0
    clusters = _average_linkage(within, cfg.dependence_threshold)
    return EnsembleReport(
        class_balance=round(p.pi, 4),
        names=names,
        est_auroc=[round(_normal_cdf(float(g / s) / math.sqrt(2.0)), 4) for g, s in zip(gap, sd, strict=True)],
        weights=[round(float(w), 4) for w in np.linalg.solve(p.cov, gap)],
        missing_share=[round(float(x), 4) for x in np.isnan(z).mean(axis=0)],
        dependent_groups=[[names[i] for i in c] for c in clusters if len(c) > 1],
        within_class_corr=[[round(float(x), 3) for x in row] for row in within],
        start=start,
        iterations=fit.iterations,
        n_candidates=len(groups),
        n_groups=len(np.unique(groups)),
        n_fit_rows=len(z),
        n_labels=0 if labels is None else int((~np.isnan(labels)).sum()),
    )
