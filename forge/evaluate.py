"""Evaluation on the held-out split: pass@1 (greedy), pass@k (k sampled completions), mean reward, samples.

A completion is correct when every eval verifier scores it >= 1.0 (a verifier that raised or returned None for it:
not correct). The eval verifiers are `eval.verifiers` when set (names or import paths, as in reward.verifiers), else
the run's correctness verifiers (`eval_verifier_specs`):
1. the built-ins in reward.verifiers that judge correctness (`registry.CORRECTNESS`: math_answer, code_exec: every
   hidden test passes), else
2. the import-path verifiers in reward.verifiers whose function name does not mention format or length
   (`format`, `length`, `len_`): a TRL `accuracy_reward` decides, its `format_reward` and `len_reward` do not;
   reward models, LLM judges and the label-free checks never do, else
3. math_answer.
They always see the reference answer column (reward.label_free only hides it from the reward, and from the
reward verifiers' call that gives `mean_reward`: `hidden`). The report names
them (`"verifiers"`) and keeps each one's first error (`"verifier_errors"`). pass@k is the share of problems
with at least one correct completion among k samples (n = k, so the unbiased estimator of Chen et al. 2021
reduces to this). Sampling for pass@k uses its own seed (`SamplingParams.seed`) and leaves the training RNG untouched, so
evaluating does not change the training trajectory. The hf backend generates `eval.batch_size` sequences per call.
In a multi-turn run (`env.*`) the backend plays episodes (`forge.env.episode.EpisodeBackend`) and the verifiers get
their environments (`environments=`); a completion is then the whole episode after the prompt. The report
adds `first_turn@1` and `final_turn@1` (the first / last policy turn of each greedy episode judged alone) and
`mean_turns`.
"""

from __future__ import annotations

import time

import torch

from forge.config import EvalConfig
from forge.rewards.config import RewardConfig
from forge.rewards.registry import CORRECTNESS, resolve_verifier
from forge.rewards.score import score_completions
from forge.rollout.base import RolloutBackend, SamplingParams
from forge.rollout.config import RolloutConfig

_NOT_CORRECTNESS = ("format", "length", "len_")
"""A user verifier whose function name contains one of these scores form, not correctness: it does not decide eval."""


def evaluate(
    backend: RolloutBackend,
    rows: list[dict],
    cfg: EvalConfig,
    rollout: RolloutConfig,
    verifiers: list | None = None,
    weights: list[float] | None = None,
    seed: int = 0,
    timeout_s: float = 0.0,
    reward: RewardConfig | None = None,
    hidden: tuple[str, ...] = (),
) -> dict:
    """Return the eval report (JSON-ready). rows: eval split rows with model_input and answer. `verifiers`: the
    run's resolved reward verifiers (reused by name; also give `mean_reward`, called without the `hidden`
    columns, as the reward stage calls them); `reward`: the run's reward config (picks the default eval
    verifiers; None = RewardConfig()). `timeout_s`: each verifier's budget for the batch (reward.score_timeout_s;
    0 = none)."""
    start = time.perf_counter()
    rows = rows[: cfg.max_problems]
    prompts = [r["model_input"] for r in rows]
    answers = [r["answer"] for r in rows]
    max_new = cfg.max_new_tokens or rollout.max_new_tokens
    greedy = backend.generate(
        prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0, n=1, batch_size=cfg.batch_size)
    )
    reward = reward or RewardConfig()
    judges = resolve_eval_verifiers(eval_verifier_specs(cfg, reward), verifiers, reward)
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "model_input")} if rows else {}
    errors: dict[str, str] = {}
    raw = [r["prompt"] for r in rows]  # strings or chat messages: what TRL-style verifiers get as `prompts`
    correct = _correct(judges, prompts, raw, greedy.texts, columns, timeout_s, errors, _envs(greedy))
    report = {
        "problems": len(rows),
        "pass@1": _mean(correct),
        "verifiers": [name for name, _ in judges],
        "policy_version": greedy.policy_version,
        "mean_completion_tokens": float(greedy.completion_mask.sum(1).float().mean()),
    }
    if greedy.episodes is not None:
        report.update(_turn_split(judges, prompts, raw, greedy, columns, timeout_s, errors))
    if verifiers:
        seen = {k: v for k, v in columns.items() if k not in hidden}
        res = score_completions(verifiers, weights, prompts, greedy.texts, seen, timeout_s=timeout_s, raw_prompts=raw,
                                environments=_envs(greedy))  # fmt: skip
        report["mean_reward"] = float(res.rewards.mean()) if len(rows) else 0.0
    if cfg.k > 0 and rows:
        report[f"pass@{cfg.k}"] = _pass_at_k(
            backend, prompts, raw, columns, cfg, rollout, seed, judges, timeout_s, errors
        )
    if errors:
        report["verifier_errors"] = errors
    report["samples"] = [
        {"prompt": r["prompt"], "completion": t, "answer": a, "correct": bool(c)}
        for r, t, a, c in list(zip(rows, greedy.texts, answers, correct, strict=True))[: cfg.num_samples_saved]
    ]
    report["seconds"] = time.perf_counter() - start
    return report


def eval_verifier_specs(cfg: EvalConfig, reward: RewardConfig) -> list[str]:
    """The specs of the verifiers that decide correctness (rule: module docstring). Pure: nothing is resolved.

    >>> r = RewardConfig(verifiers=["format_tags", "mypkg.rewards:accuracy_reward", "mypkg.rewards:format_reward"])
    >>> eval_verifier_specs(EvalConfig(), r), eval_verifier_specs(EvalConfig(), RewardConfig(verifiers=["concise"]))
    (['mypkg.rewards:accuracy_reward'], ['math_answer'])
    """
    if cfg.verifiers:
        return list(cfg.verifiers)
    specs = [s.strip() for s in reward.verifiers]
    builtin = [s for s in specs if s in CORRECTNESS]
    user = [s for s in specs if _is_import_path(s) and not any(w in _attr(s).lower() for w in _NOT_CORRECTNESS)]
    return builtin or user or ["math_answer"]


def resolve_eval_verifiers(specs: list[str], run: list | None, reward: RewardConfig) -> list[tuple[str, object]]:
    """(name, fn) per spec: the run's own instance when one of its verifiers has that name, else resolved anew."""
    mine = dict(run or [])
    out = []
    for spec in specs:
        name = _attr(spec) if _is_import_path(spec) else spec.split("=", 1)[0]
        out.append((name, mine[name]) if name in mine else resolve_verifier(spec, reward))
    return out


def _is_import_path(spec: str) -> bool:
    return ":" in spec and "=" not in spec.split(":", 1)[0]


def _attr(spec: str) -> str:
    return spec.rpartition(":")[2]


def _envs(ro) -> list | None:
    """Multi-turn: the episodes' environments, for reward functions that read them (`environments=`)."""
    return ro.episodes.environments if ro.episodes is not None else None


def _correct(
    judges, prompts: list[str], raw: list, texts: list[str], columns: dict, timeout_s: float, errors: dict,
    environments: list | None = None,
) -> list[bool]:  # fmt: skip
    """Whether every judge scores each completion >= 1.0 (NaN: it failed on it). First errors go into `errors`.
    `raw`: the data's prompts (strings or message lists), so chat-style verifiers get message completions."""
    res = score_completions(
        verifiers=judges,
        weights=None,
        prompts=prompts,
        completions=texts,
        columns=columns,
        timeout_s=timeout_s,
        raw_prompts=raw,
        environments=environments,
    )
    for name, err in res.errors.items():
        errors.setdefault(name, err)
    return (res.scores >= 1.0).all(dim=1).tolist() if len(texts) else []


def _turn_split(judges, prompts: list[str], raw: list, ro, columns: dict, timeout_s: float, errors: dict) -> dict:
    """Multi-turn: `first_turn@1` and `final_turn@1`, the share of greedy episodes whose first / last policy turn
    alone (its text as the completion) is correct, and `mean_turns`. The verifiers get no environments here (they
    hold the whole episode's state), so a verifier that reads only them scores neither."""
    turns = [[s["content"] for s in t if s["role"] == "assistant"] or [""] for t in ro.episodes.transcripts]
    first = _correct(judges, prompts, raw, [t[0] for t in turns], columns, timeout_s, errors)
    final = _correct(judges, prompts, raw, [t[-1] for t in turns], columns, timeout_s, errors)
    return {"first_turn@1": _mean(first), "final_turn@1": _mean(final), "mean_turns": _mean(ro.episodes.turns)}


def _pass_at_k(
    backend, prompts, raw, columns, cfg: EvalConfig, rollout: RolloutConfig, seed, judges, timeout_s, errors
):
    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
        temperature=cfg.temperature,
        top_p=rollout.top_p,
        n=cfg.k,
        seed=seed,
        batch_size=cfg.batch_size,
    )
    sampled = backend.generate(prompts, params)
    repeated = {key: [v for v in col for _ in range(cfg.k)] for key, col in columns.items()}
    raw_k = [p for p in raw for _ in range(cfg.k)]
    hits = _correct(judges, sampled.prompts, raw_k, sampled.texts, repeated, timeout_s, errors, _envs(sampled))
    per_problem = torch.tensor(hits, dtype=torch.float32).view(len(prompts), cfg.k)
    return float((per_problem.max(dim=1).values > 0).float().mean())


def _mean(xs) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0
