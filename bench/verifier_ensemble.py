"""Weak-verifier ensemble benchmark: synthetic candidates with hidden labels, scored by weak verifiers.

Compares, per scenario and over seeds (mean +- 95% t-interval): majority vote over final answers, the naive mean of
rank-normalised verifier scores, the best single verifier chosen on 1% labelled candidates, forge's label-free
`WeakVerifierEnsemble` ("ours"), and the oracle pass@K. Metrics: Select@1 (is the argmax of a prompt's K candidates
correct; ties count as a uniform pick), gap closed = (Sel - MV) / (Pass@K - MV), within-prompt AUROC (mean over
prompts with both classes), Brier and ECE (10 bins; only "ours" outputs probabilities, the others' scores in [0, 1]
are scored as if they were), tie rate (share of within-prompt candidate pairs with equal scores), fit seconds.

The generator (see `make_task`): per prompt a success rate from a U-shaped Beta with the scenario's base rate; each
candidate correct with that rate; in 70% of prompts 40-90% of the wrong candidates share one popular wrong answer
(which then often beats the right one in majority vote, and which verifiers find partly convincing); lengths, with
wrong answers a little longer.
Verifiers: nominal AUROC from 0.35 (adversarial) through 0.5 (useless) to 0.9, per-prompt score offsets, length
bias, families of verifiers with correlated errors, exact or near duplicates, missing scores, and output kinds
(logit, probability, 1-10 grade, 0/1 check), plus answer agreement and raw length as verifiers.

Usage: python bench/verifier_ensemble.py [--seeds 10] [--quick] [--scenarios default,dup5] [--prompts 1000]
(about 10 minutes for all scenarios at 10 seeds on 2 shared cores; prefer `nice -n 10`)
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from forge.rewards.ensemble import WeakVerifierEnsemble


@dataclass(frozen=True)
class Scenario:
    name: str
    base_rate: float = 0.4  # mean share of correct candidates
    rho: float = 0.5  # error correlation inside a family of verifiers
    families: int = 2  # families of correlated verifiers
    family_size: int = 4
    near_copies: int = 2  # extra "min/max of the same model" copies of one verifier (noisy, other output kind)
    duplicates: int = 0  # extra exact copies of one mediocre, length-biased verifier
    prompts: int = 1000  # B
    k: int = 16  # candidates per prompt


SCENARIOS = {
    "default": Scenario("default"),
    "independent": Scenario("independent", rho=0.0, families=0, near_copies=0),
    "corr0.3": Scenario("corr0.3", rho=0.3, families=3, family_size=4, near_copies=0),
    "corr0.6": Scenario("corr0.6", rho=0.6, families=3, family_size=4, near_copies=0),
    "corr0.9": Scenario("corr0.9", rho=0.9, families=3, family_size=4, near_copies=0),
    "dup5": Scenario("dup5", families=0, near_copies=0, duplicates=5),
    "base0.1": Scenario("base0.1", base_rate=0.1),
    "base0.8": Scenario("base0.8", base_rate=0.8),
}


@dataclass(frozen=True)
class Task:
    scores: np.ndarray  # [N, V] raw verifier scores, NaN = missing
    groups: np.ndarray  # [N] prompt id; N = B * K, rows of one prompt are contiguous
    labels: np.ndarray  # [N] 1 = correct
    answers: np.ndarray  # [N] final-answer id within the prompt (0 = the right answer)
    names: list[str]  # [V]


# ---------------------------------------------------------------- generator


def make_task(sc: Scenario, seed: int) -> Task:
    rng = np.random.default_rng(seed)
    b, k = sc.prompts, sc.k
    concentration = 0.9  # a + b < 2 with both < 1: U-shaped difficulty (many prompts all right or all wrong)
    rate = rng.beta(concentration * sc.base_rate, concentration * (1 - sc.base_rate), size=b)
    labels = (rng.random((b, k)) < rate[:, None]).astype(np.int64)  # [B, K]
    answers, popular = _answers(labels, rng)
    length = rng.normal(size=(b, k)) + 0.3 * (1 - labels)  # wrong answers ramble a little
    specs = _verifier_specs(sc, rng)
    cols, names = [], []
    latent_cache: dict[int, np.ndarray] = {}
    family_noise = {f: rng.normal(size=(b, k)) for f in range(sc.families)}
    for i, spec in enumerate(specs):
        src = spec.get("copy_of")
        if src is not None and spec["extra_noise"] == 0.0:  # an exact duplicate: the same column, gaps included
            cols.append(cols[src].copy())
            names.append(spec["name"])
            continue
        if src is not None:
            u = latent_cache[src] + spec["extra_noise"] * rng.normal(size=(b, k))
        else:
            u = _latent(spec, labels, length, popular, family_noise, sc.rho, rng)
        latent_cache[i] = u
        cols.append(_missing(_output(spec["kind"], u, rng), spec["missing"], rng))
        names.append(spec["name"])
    cols.append((answers[:, :, None] == answers[:, None, :]).mean(axis=2))  # answer agreement
    names.append("agreement")
    cols.append(np.round(50 + 15 * length))  # raw length in "tokens"
    names.append("length")
    scores = np.stack([c.reshape(-1) for c in cols], axis=1)
    groups = np.repeat(np.arange(b), k)
    return Task(scores, groups, labels.reshape(-1), answers.reshape(-1), names)


def _answers(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Answer ids (0 = right). Most prompts have one popular wrong answer taken by many wrong candidates."""
    b, k = labels.shape
    has_popular = rng.random(b) < 0.7
    share = rng.uniform(0.4, 0.9, size=b)
    takes_popular = (rng.random((b, k)) < share[:, None]) & has_popular[:, None] & (labels == 0)
    scattered = rng.integers(2, 2 + 2 * k, size=(b, k))
    answers = np.where(labels == 1, 0, np.where(takes_popular, 1, scattered))
    return answers, takes_popular


def _verifier_specs(sc: Scenario, rng: np.random.Generator) -> list[dict]:
    bands = [(0.8, 0.9)] * 3 + [(0.65, 0.8)] * 5 + [(0.55, 0.65)] * 3 + [(0.5, 0.5)] * 2 + [(0.35, 0.45)]
    kinds = ["logit", "prob", "grade", "binary"]
    specs = []
    for i, (lo, hi) in enumerate(bands):
        specs.append({
            "name": f"q{i:02d}", "auroc": rng.uniform(lo, hi), "kind": kinds[rng.integers(len(kinds))],
            "length_bias": rng.uniform(0.0, 0.6) if rng.random() < 0.5 else 0.0,
            "prompt_sd": rng.uniform(0.0, 0.7), "fooled": rng.uniform(0.0, 0.6),
            "missing": rng.uniform(0.05, 0.2) if rng.random() < 0.25 else 0.0, "family": None,
        })  # fmt: skip
    order = rng.permutation(len(specs))
    for f in range(sc.families):
        for i in order[f * sc.family_size : (f + 1) * sc.family_size]:
            specs[i]["family"] = f
    base = len(specs)
    src = int(rng.integers(0, 8))  # a strong or medium verifier: "min/max of the same reward model"
    for c in range(sc.near_copies):
        specs.append({"name": f"q{src:02d}_copy{c}", "copy_of": src, "extra_noise": 0.3,
                      "kind": kinds[rng.integers(len(kinds))], "missing": 0.0})  # fmt: skip
    mediocre = 8 + int(rng.integers(0, 3))  # a weak verifier, made length-biased
    specs[mediocre]["length_bias"] = 0.6
    for c in range(sc.duplicates):
        specs.append({"name": f"q{mediocre:02d}_dup{c}", "copy_of": mediocre, "extra_noise": 0.0,
                      "kind": specs[mediocre]["kind"], "missing": 0.0})  # fmt: skip
    assert len(specs) == base + sc.near_copies + sc.duplicates
    return specs


def _latent(spec: dict, labels, length, popular, family_noise, rho, rng) -> np.ndarray:
    b, k = labels.shape
    gap = math.sqrt(2) * _ndtri(spec["auroc"])  # AUROC of N(gap, 1) vs N(0, 1)
    noise = rng.normal(size=(b, k))
    if spec["family"] is not None:
        noise = math.sqrt(rho) * family_noise[spec["family"]] + math.sqrt(1 - rho) * noise
    offset = spec["prompt_sd"] * rng.normal(size=(b, 1))
    fooled = spec["fooled"] * gap * popular  # a popular wrong answer looks partly right
    return gap * labels + fooled + spec["length_bias"] * length + offset + noise


def _output(kind: str, u: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if kind == "logit":
        return rng.uniform(0.5, 3.0) * u + rng.uniform(-2, 2)
    if kind == "prob":
        return 1.0 / (1.0 + np.exp(-(1.5 * u - 0.5)))
    if kind == "grade":
        return np.clip(np.round(5.5 + 2.0 * u), 1, 10)
    return (u > rng.uniform(-0.3, 0.8)).astype(np.float64)


def _missing(col: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    return np.where(rng.random(col.shape) < rate, np.nan, col)


def _ndtri(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if 0.5 * math.erfc(-mid / math.sqrt(2)) < p else (lo, mid)
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------- methods: each returns [N] scores, seconds


def majority_vote(task: Task, rng: np.random.Generator) -> np.ndarray:
    k = _k(task)
    a = task.answers.reshape(-1, k)
    return (a[:, :, None] == a[:, None, :]).mean(axis=2).reshape(-1)


def _rank01(col: np.ndarray) -> np.ndarray:
    """Mid-rank percentile in [0, 1] over the present values; NaN stays NaN."""
    out = np.full(col.shape, np.nan)
    present = ~np.isnan(col)
    values, inverse, counts = np.unique(col[present], return_inverse=True, return_counts=True)
    mid = (np.cumsum(counts) - 0.5 * counts) / counts.sum()
    out[present] = mid[inverse]
    return out


def naive_mean(task: Task, rng: np.random.Generator) -> np.ndarray:
    ranks = np.stack([_rank01(task.scores[:, v]) for v in range(task.scores.shape[1])], axis=1)
    return np.nanmean(ranks, axis=1)


def best_single_1pct(task: Task, rng: np.random.Generator) -> np.ndarray:
    n = len(task.labels)
    idx = rng.choice(n, size=max(20, n // 100), replace=False)
    aurocs = [_pooled_auroc(task.scores[idx, v], task.labels[idx]) for v in range(task.scores.shape[1])]
    col = _rank01(task.scores[:, int(np.argmax(aurocs))])
    return np.where(np.isnan(col), 0.5, col)


def _pooled_auroc(s: np.ndarray, y: np.ndarray) -> float:
    keep = ~np.isnan(s)
    s, y = s[keep], y[keep]
    if y.min() == y.max():
        return 0.5
    r = _rank01(s)
    return _mw(r, y)


def _mw(r: np.ndarray, y: np.ndarray) -> float:
    n1, n0 = int(y.sum()), int((1 - y).sum())
    ranks = r * len(r) + 0.5  # 1-based mid-ranks
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def ours(task: Task, rng: np.random.Generator) -> np.ndarray:
    return fit_ours(task)[0]


def fit_ours(task: Task) -> tuple[np.ndarray, dict]:
    """forge's label-free ensemble: fit on the task's scores alone, then P(correct) per candidate and its report."""
    ens = WeakVerifierEnsemble().fit(task.scores, task.groups, names=task.names)
    return ens.predict_proba(task.scores, task.groups), ens.report()


def oracle(task: Task, rng: np.random.Generator) -> np.ndarray:
    return task.labels.astype(np.float64)


METHODS: dict[str, Callable[[Task, np.random.Generator], np.ndarray]] = {
    "majority vote": majority_vote,
    "naive mean": naive_mean,
    "best single (1% labels)": best_single_1pct,
    "ours (label-free)": ours,
    "oracle pass@K": oracle,
}


# ---------------------------------------------------------------- metrics


def _k(task: Task) -> int:
    return int(np.bincount(task.groups).max())


def metrics(task: Task, p: np.ndarray) -> dict[str, float]:
    k = _k(task)
    s, y = p.reshape(-1, k), task.labels.reshape(-1, k)  # [B, K]
    top = s >= s.max(axis=1, keepdims=True)
    select = (top * y).sum(axis=1) / top.sum(axis=1)
    upper = np.triu(np.ones((k, k), dtype=bool), k=1)
    ties = (s[:, :, None] == s[:, None, :])[:, upper].mean()
    return {
        "select@1": 100 * float(select.mean()),
        "pass@K": 100 * float((y.max(axis=1) > 0).mean()),
        "auroc": _within_auroc(s, y),
        "brier": float(np.mean((p - task.labels) ** 2)),
        "ece": _ece(p, task.labels),
        "ties": float(ties),
    }


def _within_auroc(s: np.ndarray, y: np.ndarray) -> float:
    mixed = (y.min(axis=1) == 0) & (y.max(axis=1) == 1)
    s, y = s[mixed], y[mixed]
    pos_neg = y[:, :, None] * (1 - y[:, None, :])  # [B, K, K] pairs (right i, wrong j)
    wins = (s[:, :, None] > s[:, None, :]) + 0.5 * (s[:, :, None] == s[:, None, :])
    return float(((wins * pos_neg).sum(axis=(1, 2)) / pos_neg.sum(axis=(1, 2))).mean())


def _ece(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    p = np.clip(np.nan_to_num(p, nan=0.5), 0.0, 1.0)
    idx = np.minimum((p * bins).astype(int), bins - 1)
    n = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, weights=p, minlength=bins) - np.bincount(idx, weights=y, minlength=bins))
    return float(gap.sum() / n.sum())


# ---------------------------------------------------------------- runner and table

_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 14: 2.14, 19: 2.09}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs, dtype=np.float64)
    if len(a) < 2:
        return float(a.mean()), float("nan")
    df = len(a) - 1
    t = _T975.get(df, 2.0 if df > 19 else _T975[max(d for d in _T975 if d <= df)])
    return float(a.mean()), float(t * a.std(ddof=1) / math.sqrt(len(a)))


def run_scenario(sc: Scenario, seeds: list[int]) -> dict[str, dict[str, list[float]]]:
    """Per method, per metric: one value per seed. "ours" also records its class-balance error."""
    out: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
    for seed in seeds:
        task = make_task(sc, seed)
        mv = None
        for name, fn in METHODS.items():
            t0 = time.perf_counter()
            if name == "ours (label-free)":
                p, report = fit_ours(task)
                out[name].setdefault("balance_err", []).append(abs(report["class_balance"] - task.labels.mean()))
            else:
                p = fn(task, np.random.default_rng(seed + 7919))
            seconds = time.perf_counter() - t0
            m = metrics(task, p)
            mv = m["select@1"] if name == "majority vote" else mv
            m["gap"] = 100 * (m["select@1"] - mv) / max(m["pass@K"] - mv, 1e-9)
            m["sec"] = seconds
            for key, val in m.items():
                out[name].setdefault(key, []).append(val)
    return out


COLUMNS = [("select@1", "Select@1", 1), ("gap", "gap closed %", 1), ("auroc", "AUROC", 3), ("brier", "Brier", 3),
           ("ece", "ECE", 3), ("ties", "tie rate", 3), ("sec", "fit s", 2)]  # fmt: skip


def format_table(sc: Scenario, res: dict[str, dict[str, list[float]]], n_verifiers: int) -> str:
    head = f"\n### {sc.name}  (base rate {sc.base_rate}, rho {sc.rho}, {sc.families} families, "
    head += f"{sc.near_copies} near copies, {sc.duplicates} exact duplicates; V={n_verifiers}, B={sc.prompts}, K={sc.k})\n\n"
    lines = ["| method | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, m in res.items():
        cells = []
        for key, _, digits in COLUMNS:
            mu, ci = mean_ci(m[key])
            cells.append(f"{mu:.{digits}f} ± {ci:.{digits}f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n\n" + _paired_lines(res)


def _paired_lines(res: dict[str, dict[str, list[float]]]) -> str:
    ours_sel = np.asarray(res["ours (label-free)"]["select@1"])
    mu, ci = mean_ci(res["ours (label-free)"]["balance_err"])
    out = [f"ours: |estimated − true share of correct candidates| = {mu:.3f} ± {ci:.3f}"]
    for base in ("naive mean", "best single (1% labels)", "majority vote"):
        mu, ci = mean_ci(list(ours_sel - np.asarray(res[base]["select@1"])))
        out.append(f"ours − {base}: {mu:+.2f} ± {ci:.2f} Select@1 points (paired over seeds)")
    return "\n".join(f"- {line}" for line in out) + "\n"


def acceptance(results: dict[str, dict[str, dict[str, list[float]]]]) -> str:
    """The issue's checks: default gap closed >= 50%; ours >= naive mean (within noise) and >= best single - 1."""
    lines = ["| scenario | gap closed % | ours − naive mean | ours − best single (1% labels) |", "|---|---|---|---|"]
    for name, res in results.items():
        ours_sel = np.asarray(res["ours (label-free)"]["select@1"])
        gap = mean_ci(res["ours (label-free)"]["gap"])
        vs = [
            mean_ci(list(ours_sel - np.asarray(res[b]["select@1"]))) for b in ("naive mean", "best single (1% labels)")
        ]
        lines.append(
            f"| {name} | {gap[0]:.1f} ± {gap[1]:.1f} | " + " | ".join(f"{m:+.2f} ± {c:.2f}" for m, c in vs) + " |"
        )
    return "Acceptance (Select@1 points, paired over seeds):\n\n" + "\n".join(lines)


def duplicate_stability(seeds: list[int], prompts: int) -> tuple[float, float, float]:
    """|change in our Select@1| when one verifier (drawn per seed) is copied 5 more times; default scenario."""
    deltas = []
    for seed in seeds:
        task = make_task(replace(SCENARIOS["default"], prompts=prompts), seed)
        v = int(np.random.default_rng(seed).integers(task.scores.shape[1]))
        dup = Task(np.concatenate([task.scores] + [task.scores[:, [v]]] * 5, axis=1), task.groups, task.labels,
                   task.answers, task.names + [f"{task.names[v]}_x{i}" for i in range(5)])  # fmt: skip
        deltas.append(abs(metrics(dup, fit_ours(dup)[0])["select@1"] - metrics(task, fit_ours(task)[0])["select@1"]))
    mu, ci = mean_ci(deltas)
    return mu, ci, max(deltas)


def speed_check(n: int = 100_000, v: int = 30) -> float:
    rng = np.random.default_rng(0)
    y = rng.random(n) < 0.4
    scores = rng.normal(size=(n, v)) + np.linspace(-0.5, 1.5, v) * y[:, None]
    scores[rng.random((n, v)) < 0.05] = np.nan
    t0 = time.perf_counter()
    WeakVerifierEnsemble().fit(scores, np.arange(n) // 16)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10, help="seeds per scenario (default 10)")
    ap.add_argument("--quick", action="store_true", help="3 seeds, 300 prompts: a smoke run, not a result")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of: " + ",".join(SCENARIOS)
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per task (default per scenario: 1000)")
    args = ap.parse_args()
    if args.seeds < 2:
        ap.error("--seeds must be at least 2 (the intervals need two)")
    seeds = list(range(3 if args.quick else args.seeds))
    prompts = 300 if args.quick else args.prompts
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    print(f"seeds {seeds[0]}..{seeds[-1]} ({len(seeds)}); mean ± 95% t-interval over seeds")
    results = {}
    for name in names:
        sc = SCENARIOS[name] if prompts is None else replace(SCENARIOS[name], prompts=prompts)
        results[name] = run_scenario(sc, seeds)
        print(format_table(sc, results[name], make_task(replace(sc, prompts=4), 0).scores.shape[1]), flush=True)
    print("\n" + acceptance(results))
    mu, ci, worst = duplicate_stability(seeds, prompts or SCENARIOS["default"].prompts)
    print(
        "\nduplicate stability (default scenario, one verifier copied 5 more times): "
        f"|Δ Select@1| = {mu:.2f} ± {ci:.2f} points (worst seed {worst:.2f})"
    )
    if not args.quick:
        print(f"fit time on 100,000 x 30 (5% of scores missing at random): {speed_check():.2f} s")


if __name__ == "__main__":
    main()
