"""Label-free latent class model for discrete verifiers: P(candidate correct | V votes), fit by EM without labels.

Same API as `forge.rewards.ensemble.WeakVerifierEnsemble` (`fit(scores, groups)`, `predict_proba`, `report`), for
verifiers that answer with a few values: 0/1 rule checks (parity, residues, format), pass/fail tests, 1-5 grades.

Why a second model: the Gaussian ensemble works on normal scores and separates classes with a linear discriminant,
so every check that passes adds the same fixed amount of evidence and every one that fails takes the same amount
away. Necessary-condition checks are not like that: a correct answer passes every one of them, a wrong one passes
each by chance. The right answer to "passed 4 of 5 checks" is then "certainly wrong", which only a model with a
per-class, per-value probability can say. The classic model for discrete votes is the latent class model (Dawid &
Skene, 1979; Snorkel's label model is its two-class binary case):

1. Values. Each verifier's scores are cut into at most `levels` categories: its distinct values when it has that
   few (a 0/1 check stays 0/1), otherwise equal-count quantile bins. A missing score (NaN) is left out of the
   product below, so a candidate is never dropped.
2. Model. K latent classes with shares pi_k; within a class every verifier's category is drawn independently from
   its own categorical distribution theta_kv. EM with `smoothing` pseudo-counts per category (a check that a class
   always passes keeps a small probability of failing: one failed check makes a candidate very unlikely, not
   impossible). K = 3 by default: correct, wrong-but-well-formed, malformed; the classes can only model kinds of
   wrong, never which wrong answer is popular (use `group_agreement` with the Gaussian ensemble for that).
3. EM runs on the distinct vote patterns with their counts (a few dozen for a handful of checks, however many
   candidates), so it is fast. Starts: K equal-count bins of the mean category level (each verifier's category index scaled to [0, 1]), each
   verifier alone, and `random_starts` random posteriors; each runs EM to convergence and the highest
   log-likelihood wins (EM on a mixture has several optima; these few rows make many starts cheap).
4. Orientation: class 0 ("correct") is the class with the highest mean level over the verifiers, as in the
   Gaussian ensemble: verifiers are assumed better than chance on average.
5. Necessary verifiers (optional, `necessary`): checks that by construction never fail a correct answer (a rule a
   true result must satisfy: parity, a residue, a digit count, a unit test of a required behaviour). Class 0 is
   pinned to their top category with probability 1 - `leak` in every M-step and stays class 0; everything else is
   still fit. Without this, RL breaks the model from the policy side: once the policy produces many answers that
   pass all but one check (measured on the tiny task: "999" for 9, which fails only the digit count), the refit
   on those rollouts explains them as correct ones with a noisy check, rewards them, and the policy collapses onto
   them. A pinned class 0 cannot absorb a failed check, so such answers end in a wrong class and lose their reward.
6. Output: the posterior of class 0 (naive Bayes over the verifiers with the fitted shares as prior).

`report()` gives the estimated class balance, and per verifier an implied AUROC (correct class vs the rest) and a
weight: the difference of the mean level between the correct class and the wrong ones (the direction the model
rewards; `forge.rewards.aggregate.refit_verdict` compares it between refits). No labels are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from forge.errors import UserError
from forge.rewards.ensemble import _check_inputs, _check_names


@dataclass(frozen=True)
class LatentClassConfig:
    classes: int = 3
    """Latent classes K: correct plus K - 1 kinds of wrong."""
    levels: int = 4
    """Categories per verifier at most: a verifier with more distinct scores is cut at quantiles."""
    smoothing: float = 0.5
    """Pseudo-count added to every category of every class in each M-step."""
    max_iter: int = 300
    """EM steps at most per start."""
    tol: float = 1e-6
    """EM stops when the mean log-likelihood per candidate improves by less than this."""
    random_starts: int = 4
    """Random initial posteriors tried besides the mean-level and single-verifier starts."""
    necessary: tuple[int, ...] = ()
    """Verifiers (column indices) that are necessary conditions: a correct candidate gets their top category."""
    leak: float = 1e-3
    """P(a correct candidate is below the top category of a necessary verifier): room for a buggy check."""
    seed: int = 0
    """Seed of the random starts; the fit is deterministic given it."""

    def __post_init__(self) -> None:
        if self.classes < 2:
            raise UserError("LatentClassConfig.classes: need a correct class and at least one wrong class")
        if self.levels < 2:
            raise UserError("LatentClassConfig.levels: a verifier needs at least 2 categories")
        if not 0 < self.leak < 0.5:
            raise UserError("LatentClassConfig.leak: must be in (0, 0.5)")


@dataclass(frozen=True)
class _Params:
    log_pi: np.ndarray  # [K] log class shares, class 0 = correct once oriented
    log_theta: np.ndarray  # [K, C] log P(category | class), the verifiers' categories side by side
    sizes: tuple[int, ...]  # [V] categories per verifier (C = their sum)

    def per_verifier(self) -> list[np.ndarray]:
        """[K, C_v] log P(category | class) for each verifier."""
        return np.split(self.log_theta, np.cumsum(self.sizes)[:-1], axis=1)


class LatentClassEnsemble:
    """Fit on unlabeled discrete verifier scores; predict P(correct). See the module docstring for the method."""

    def __init__(self, config: LatentClassConfig | None = None) -> None:
        self.config = config or LatentClassConfig()
        self._cuts: list[np.ndarray] | None = None
        self._params: _Params | None = None
        self._report: dict | None = None

    def fit(self, scores: np.ndarray, groups: np.ndarray, names: Sequence[str] | None = None) -> LatentClassEnsemble:
        """scores [N, V] (NaN = missing), groups [N] prompt ids (kept for API parity; the model does not use them)."""
        scores, groups = _check_inputs(scores, groups)
        names = _check_names(names, scores.shape[1])
        self._cuts = [_cut_points(scores[:, v], self.config.levels) for v in range(scores.shape[1])]
        codes = _encode(self._cuts, scores)
        sizes = tuple(len(c) + 1 for c in self._cuts)
        patterns, counts = np.unique(codes, axis=0, return_counts=True)  # EM on distinct vote patterns
        start, params, loglik = _best_fit(patterns, counts.astype(np.float64), sizes, self.config)
        self._params = _orient(params, keep_first=bool(self.config.necessary))
        self._report = _make_report(self._params, names, start, loglik, codes, len(np.unique(groups)))
        return self

    def predict_proba(self, scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """[N] probability that each candidate is correct."""
        if self._params is None or self._cuts is None:
            raise UserError("LatentClassEnsemble.predict_proba: call fit(scores, groups) first")
        scores, groups = _check_inputs(scores, groups, n_verifiers=len(self._cuts))
        joint = _joint(_onehot(_encode(self._cuts, scores), self._params.sizes), self._params)
        return np.exp(joint[:, 0] - _logsumexp(joint))

    def report(self) -> dict:
        """Class balance and shares, per-verifier implied AUROC and weight, the winning start (a JSON-able dict)."""
        if self._report is None:
            raise UserError("LatentClassEnsemble.report: call fit(scores, groups) first")
        return dict(self._report)

    def state_dict(self) -> dict:
        """The fitted model as arrays and JSON values (for checkpoints): `load_state_dict` predicts the same."""
        if self._params is None or self._cuts is None or self._report is None:
            raise UserError("LatentClassEnsemble.state_dict: call fit(scores, groups) first")
        p = self._params
        params = {"log_pi": p.log_pi, "log_theta": p.log_theta, "sizes": list(p.sizes)}
        return {"cuts": list(self._cuts), "params": params, "report": dict(self._report)}

    def load_state_dict(self, state: dict) -> LatentClassEnsemble:
        p = state["params"]
        self._cuts = [np.asarray(c, dtype=np.float64) for c in state["cuts"]]
        self._params = _Params(np.asarray(p["log_pi"]), np.asarray(p["log_theta"]), tuple(int(x) for x in p["sizes"]))
        self._report = dict(state["report"])
        return self


# ---------------------------------------------------------------- categories


def _cut_points(col: np.ndarray, levels: int) -> np.ndarray:
    """Sorted thresholds: category = how many thresholds a score reaches (midpoints, or quantiles if many values)."""
    values = np.unique(col[~np.isnan(col)])
    if len(values) <= levels:
        return (values[1:] + values[:-1]) / 2.0
    inner = np.quantile(col[~np.isnan(col)], np.arange(1, levels) / levels)
    return np.unique(inner)


def _encode(cuts: list[np.ndarray], scores: np.ndarray) -> np.ndarray:
    """[N, V] int category per score, -1 where missing."""
    codes = np.full(scores.shape, -1, dtype=np.int64)
    for v, c in enumerate(cuts):
        present = ~np.isnan(scores[:, v])
        codes[present, v] = np.searchsorted(c, scores[present, v], side="right")
    return codes


def _levels(codes: np.ndarray, sizes: list[int]) -> np.ndarray:
    """[N] mean over observed verifiers of the category index scaled to [0, 1] (0.5 when none is observed)."""
    scaled = np.where(codes >= 0, codes / np.maximum(np.array(sizes) - 1, 1), np.nan)
    observed = ~np.isnan(scaled)
    return np.where(observed.any(axis=1), np.nansum(scaled, axis=1) / np.maximum(observed.sum(axis=1), 1), 0.5)


# ---------------------------------------------------------------- EM


def _best_fit(
    codes: np.ndarray, counts: np.ndarray, sizes: tuple[int, ...], cfg: LatentClassConfig
) -> tuple[str, _Params, float]:
    """Run EM from every start on distinct patterns codes [P, V] seen counts [P] times; the best log-likelihood wins."""
    best: tuple[str, _Params, float] | None = None
    onehot = _onehot(codes, sizes)
    for name, q0 in _starts(codes, counts, list(sizes), cfg).items():
        params, loglik = _em(onehot, counts, sizes, q0, cfg)
        if best is None or loglik > best[2] + 1e-9:
            best = (name, params, loglik)
    assert best is not None
    return best


def _starts(codes: np.ndarray, counts: np.ndarray, sizes: list[int], cfg: LatentClassConfig) -> dict[str, np.ndarray]:
    """Initial posteriors [P, K]: bins of the mean level, of each verifier alone, and random ones."""
    k = cfg.classes
    starts = {"mean level": _bins(_levels(codes, sizes), counts, k)}
    for v in range(codes.shape[1]):
        starts[f"verifier {v}"] = _bins(_levels(codes[:, v : v + 1], sizes[v : v + 1]), counts, k)
    rng = np.random.default_rng(cfg.seed)
    for i in range(cfg.random_starts):
        starts[f"random {i}"] = rng.dirichlet(np.ones(k), size=len(codes))
    return starts


def _bins(s: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """[P, K] soft assignment to K bins of s holding equal candidate counts, highest bin first."""
    order = np.argsort(s, kind="stable")
    rank = np.empty(len(s))
    rank[order] = (np.cumsum(counts[order]) - counts[order] / 2) / counts.sum()  # mid-point of each pattern's block
    q = np.full((len(s), k), 0.2 / k)
    q[np.arange(len(s)), k - 1 - np.minimum((rank * k).astype(int), k - 1)] += 0.8
    return q


def _onehot(codes: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    """[N, C] indicator of each verifier's category, the verifiers side by side; a missing score is all 0."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    onehot = np.zeros((len(codes), int(sum(sizes))))
    rows, cols = np.nonzero(codes >= 0)
    onehot[rows, offsets[cols] + codes[rows, cols]] = 1.0
    return onehot


def _em(
    onehot: np.ndarray, counts: np.ndarray, sizes: tuple[int, ...], q: np.ndarray, cfg: LatentClassConfig
) -> tuple[_Params, float]:
    """EM from posteriors q [P, K] until the mean log-likelihood stops improving; returns (params, loglik)."""
    previous = -np.inf
    for _ in range(cfg.max_iter):
        params = _pin(_m_step(onehot, sizes, q * counts[:, None], cfg.smoothing), cfg.necessary, cfg.leak)
        joint = _joint(onehot, params)  # [P, K]
        loglik = float(counts @ _logsumexp(joint) / counts.sum())
        q = np.exp(joint - _logsumexp(joint)[:, None])
        if loglik - previous < cfg.tol:
            break
        previous = loglik
    return params, loglik


def _m_step(onehot: np.ndarray, sizes: tuple[int, ...], q: np.ndarray, smoothing: float) -> _Params:
    """Class shares and per-verifier category probabilities from expected class counts q [P, K], with pseudo-counts."""
    pi = (q.sum(axis=0) + 1e-3) / (q.sum() + 1e-3 * q.shape[1])
    counts = q.T @ onehot + smoothing  # [K, C]
    totals = np.add.reduceat(counts, np.concatenate([[0], np.cumsum(sizes)[:-1]]), axis=1)  # [K, V]
    log_theta = np.log(counts) - np.log(np.repeat(totals, sizes, axis=1))
    return _Params(np.log(pi), log_theta, sizes)


def _pin(p: _Params, necessary: tuple[int, ...], leak: float) -> _Params:
    """Class 0 gets the top category of each necessary verifier with probability 1 - leak (the rest spread evenly)."""
    if not necessary:
        return p
    log_theta = p.log_theta.copy()
    offsets = np.concatenate([[0], np.cumsum(p.sizes)[:-1]])
    for v in necessary:
        size = p.sizes[v]
        if size > 1:  # a verifier with one value in the fit data says nothing either way
            log_theta[0, offsets[v] : offsets[v] + size - 1] = np.log(leak / (size - 1))
            log_theta[0, offsets[v] + size - 1] = np.log(1.0 - leak)
    return _Params(p.log_pi, log_theta, p.sizes)


def _joint(onehot: np.ndarray, p: _Params) -> np.ndarray:
    """[N, K] log pi_k + sum over observed verifiers of log theta_kv(category)."""
    return p.log_pi + onehot @ p.log_theta.T


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=1)
    return top + np.log(np.exp(x - top[:, None]).sum(axis=1))


def _mean_levels(p: _Params) -> np.ndarray:
    """[K, V] expected category index scaled to [0, 1] per class and verifier."""
    cols = [np.exp(lt) @ (np.arange(lt.shape[1]) / max(lt.shape[1] - 1, 1)) for lt in p.per_verifier()]
    return np.stack(cols, axis=1)


def _orient(p: _Params, keep_first: bool = False) -> _Params:
    """Order classes by mean level over the verifiers, highest first: class 0 is "correct".

    With necessary verifiers class 0 is pinned to pass them (`_pin`), so it stays first and only the rest are ordered.
    """
    order = np.argsort(-_mean_levels(p).mean(axis=1), kind="stable")
    if keep_first:
        order = np.concatenate([[0], order[order != 0]])
    return _Params(p.log_pi[order], p.log_theta[order], p.sizes)


# ---------------------------------------------------------------- report


def _implied_auroc(theta_right: np.ndarray, theta_wrong: np.ndarray) -> float:
    """P(a correct candidate's category > a wrong one's) + half the chance of a tie."""
    below = np.concatenate([[0.0], np.cumsum(theta_wrong)[:-1]])
    return float(np.sum(theta_right * (below + 0.5 * theta_wrong)))


def _make_report(p: _Params, names: list[str], start: str, loglik: float, codes: np.ndarray, n_groups: int) -> dict:
    """What was estimated, in plain lists; quality and weights compare class 0 with the other classes."""
    pi = np.exp(p.log_pi)
    wrong = pi[1:] / pi[1:].sum()
    levels = _mean_levels(p)  # [K, V]
    thetas = [(np.exp(lt[0]), wrong @ np.exp(lt[1:])) for lt in p.per_verifier()]
    if start.startswith("verifier "):
        start = f"verifier {names[int(start.split()[1])]}"
    return asdict(_Report(
        class_balance=round(float(pi[0]), 4),
        class_shares=[round(float(x), 4) for x in pi],
        names=names,
        est_auroc=[round(_implied_auroc(r, w), 4) for r, w in thetas],
        weights=[round(float(x), 4) for x in levels[0] - wrong @ levels[1:]],
        missing_share=[round(float(x), 4) for x in (codes < 0).mean(axis=0)],
        dependent_groups=[],
        start=start,
        loglik=round(loglik, 5),
        n_candidates=len(codes),
        n_groups=n_groups,
    ))  # fmt: skip


@dataclass(frozen=True)
class _Report:
    class_balance: float  # estimated share of correct candidates
    class_shares: list[float]  # [K] classes from most to least correct-looking
    names: list[str]  # [V]
    est_auroc: list[float]  # [V] implied AUROC, correct class vs the others (< 0.5: scores wrong answers higher)
    weights: list[float]  # [V] mean level of the correct class minus that of the wrong ones, in [-1, 1]
    missing_share: list[float]  # [V] share of fit candidates the verifier did not score
    dependent_groups: list[list[str]]  # always empty: the model assumes independence within a class
    start: str  # which start won: "mean level", "verifier <name>" or "random <i>"
    loglik: float  # mean log-likelihood per candidate of the final fit
    n_candidates: int
    n_groups: int
