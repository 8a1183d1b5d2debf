"""Evaluation on the held-out split: pass@1 (greedy), pass@k (k sampled completions), mean reward, samples.

Correctness is a score of 1.0 from the `eval.check` verifier (default `math_answer`; `code_exec` for code tasks:
every hidden test passes) against the reference answer column. pass@k is the share of problems
with at least one correct completion among k samples (n = k, so the unbiased estimator of Chen et al. 2021
reduces to this). Sampling for pass@k uses its own seed (`SamplingParams.seed`) and leaves the training RNG untouched, so
evaluating does not change the training trajectory. The hf backend generates `eval.batch_size` sequences per call.
"""

from __future__ import annotations

import time

import torch

from forge.config import EvalConfig, RolloutConfig
from forge.rewards.score import score_completions
from forge.rewards.verifiers import math_answer
from forge.rollout.base import RolloutBackend, SamplingParams


def evaluate(
    backend: RolloutBackend,
    rows: list[dict],
    cfg: EvalConfig,
    rollout: RolloutConfig,
    verifiers: list | None = None,
    weights: list[float] | None = None,
    seed: int = 0,
    timeout_s: float = 0.0,
) -> dict:
    """Return the eval report (JSON-ready). rows: eval split rows with model_input and answer. `timeout_s`: each
    verifier's budget for the batch (reward.score_timeout_s; 0 = none)."""
    start = time.perf_counter()
    rows = rows[: cfg.max_problems]
    prompts = [r["model_input"] for r in rows]
    answers = [r["answer"] for r in rows]
    max_new = cfg.max_new_tokens or rollout.max_new_tokens
    greedy = backend.generate(
        prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0, n=1, batch_size=cfg.batch_size)
    )
    check = _check_fn(cfg.check, verifiers)
    correct = _correct(check, prompts, greedy.texts, answers)
    report = {
        "problems": len(rows),
        "pass@1": _mean(correct),
        "policy_version": greedy.policy_version,
        "mean_completion_tokens": float(greedy.completion_mask.sum(1).float().mean()),
    }
    if verifiers:
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "model_input")} if rows else {}
        res = score_completions(verifiers, weights, prompts, greedy.texts, columns, timeout_s=timeout_s)
        report["mean_reward"] = float(res.rewards.mean()) if len(rows) else 0.0
    if cfg.k > 0 and rows:
        report[f"pass@{cfg.k}"] = _pass_at_k(backend, prompts, answers, cfg, rollout, seed, check)
    report["samples"] = [
        {"prompt": r["prompt"], "completion": t, "answer": a, "correct": bool(c)}
        for r, t, a, c in list(zip(rows, greedy.texts, answers, correct, strict=True))[: cfg.num_samples_saved]
    ]
    report["seconds"] = time.perf_counter() - start
    return report


def _check_fn(name: str, verifiers: list | None):
    """The eval.check verifier: the run's own instance when it is one of reward.verifiers, else resolved by name."""
    if name == "math_answer":
        return math_answer
    for vname, fn in verifiers or []:
        if vname == name:
            return fn
    from forge.rewards.registry import resolve_verifier

    return resolve_verifier(name)[1]


def _correct(check, prompts: list[str], texts: list[str], answers: list[str]) -> list[bool]:
    return [s is not None and s >= 1.0 for s in check(prompts=prompts, completions=texts, answer=answers)]


def _pass_at_k(backend, prompts, answers, cfg: EvalConfig, rollout: RolloutConfig, seed: int, check) -> float:
    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
        temperature=cfg.temperature,
        top_p=rollout.top_p,
        n=cfg.k,
        seed=seed,
        batch_size=cfg.batch_size,
    )
    sampled = backend.generate(prompts, params)
    hits = _correct(check, sampled.prompts, sampled.texts, [a for a in answers for _ in range(cfg.k)])
    per_problem = torch.tensor(hits, dtype=torch.float32).view(len(prompts), cfg.k)
    return float((per_problem.max(dim=1).values > 0).float().mean())


def _mean(xs) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0
