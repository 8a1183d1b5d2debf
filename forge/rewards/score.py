"""The reward stage: run every verifier on a batch of completions and combine the scores by weight.

A verifier is called once on the whole batch, by keyword (`prompts=`, `completions=`, then the data columns),
so TRL reward functions written as `f(completions, **kwargs)` work too. If that call raises, the verifier is
called again item by item so one bad item does not void the batch. Items it raised on, returned None for, or
scored with a non-finite or non-numeric value get NaN and are counted as failures; a result of the wrong
length fails every item. None of this is fatal: the first error per verifier is kept for the logs.

Reward = sum_v w_v * score_v with NaN counted as 0, so a missing score is neither rewarded nor excluded. A score
beyond float32's range is a failure too, and a weighted sum that overflows is 0: nothing non-finite reaches the
advantages.

Time budget (`reward.score_timeout_s`): each verifier's work on a batch runs in a daemon thread; if it is not done
in time the stage raises a `VerifierTimeout` (a UserError naming the verifier) and the run stops, resumable from its
last checkpoint. We stop rather than count the items as failures because a Python thread cannot be killed: a hung
verifier would keep running (and holding the GIL) beside the training it was meant to score.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from forge.errors import UserError
from forge.rewards.verifiers import Verifier

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class VerifierTimeout(UserError):
    """A verifier did not finish a batch within reward.score_timeout_s."""


@dataclass(frozen=True)
class RewardResult:
    """Per-verifier scores and the weighted reward for N completions."""

    names: list[str]  # [V] verifier names, in config order
    scores: torch.Tensor  # [N, V] float32; NaN where the verifier raised or returned None for that item
    rewards: torch.Tensor  # [N] float32; sum_v w_v * score_v, NaN counted as 0
    failures: dict[str, int]  # verifier name -> items that were None / raised / non-finite (every verifier listed)
    errors: dict[str, str]  # verifier name -> first error seen (repr of the exception); only verifiers that had one


def score_completions(
    verifiers: list[tuple[str, Verifier]],
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    timeout_s: float = 0.0,
) -> RewardResult:
    """Score N completions with V verifiers. prompts and every column hold one entry per completion. Each verifier
    gets `timeout_s` seconds for the batch (0 = no limit), else VerifierTimeout."""
    n = len(completions)
    names = [name for name, _ in verifiers]
    _check_inputs(names, weights, prompts, completions, columns)
    w = torch.tensor(list(weights) if weights else [1.0] * len(verifiers), dtype=torch.float32)  # [V]
    scores = torch.full((n, len(verifiers)), math.nan, dtype=torch.float32)  # [N, V]
    failures: dict[str, int] = {}
    errors: dict[str, str] = {}
    for v, (name, fn) in enumerate(verifiers):
        column, error = _within(timeout_s, name, lambda fn=fn: _run_verifier(fn, prompts, completions, columns))
        scores[:, v] = torch.tensor(column, dtype=torch.float32)
        failures[name] = sum(math.isnan(s) for s in column)
        if error is not None:
            errors[name] = error
    rewards = (scores.double().nan_to_num(nan=0.0) * w.double()).sum(dim=1)  # [N]; float64: no overflow here
    rewards = torch.where(rewards.abs() <= FLOAT32_MAX, rewards, 0.0).float()  # a sum past float32's range: 0
    return RewardResult(names=names, scores=scores, rewards=rewards, failures=failures, errors=errors)


def _within(timeout_s: float, name: str, work):
    """work() in a daemon thread, waited for at most timeout_s seconds (0 = no limit); re-raises its error."""
    if timeout_s <= 0:
        return work()
    box: dict = {}

    def target():
        try:
            box["result"] = work()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=target, name=f"verifier-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise VerifierTimeout(
            f"verifier '{name}' did not finish scoring a batch within reward.score_timeout_s={timeout_s:g}s: make it "
            "faster (or make it return None for what it cannot score), or raise the limit; resume with --resume"
        )
    if "error" in box:
        raise box["error"]
    return box["result"]


def per_verifier_means(names: list[str], scores: torch.Tensor) -> dict[str, float]:
    """Mean score per verifier over the items it scored (NaN when it scored none); scores [N, V]."""
    return {name: float(scores[:, v].nanmean()) for v, name in enumerate(names)}


def _check_inputs(
    names: list[str], weights: list[float] | None, prompts: list[str], completions: list[str], columns: dict
) -> None:
    if weights and len(weights) != len(names):
        raise UserError(f"reward.weights has {len(weights)} values for {len(names)} verifiers; give one per verifier")
    for key in ("prompts", "completions"):
        if key in columns:
            raise UserError(f"data column '{key}' clashes with the verifier argument of that name; rename the column")
    assert len(set(names)) == len(names), f"verifier names must be unique, got {names}"
    assert len(prompts) == len(completions), f"{len(prompts)} prompts for {len(completions)} completions"
    for key, col in columns.items():
        assert len(col) == len(completions), f"column '{key}' has {len(col)} entries for {len(completions)} items"


def _run_verifier(
    fn: Verifier, prompts: list[str], completions: list[str], columns: dict[str, list]
) -> tuple[list[float], str | None]:
    """One score per item (NaN = failed) and the first error message, if any."""
    try:
        out = list(fn(prompts=prompts, completions=completions, **columns))
    except Exception as e:
        items = [_run_item(fn, prompts, completions, columns, i) for i in range(len(completions))]
        return [s for s, _ in items], repr(e)
    if len(out) != len(completions):
        return [math.nan] * len(completions), f"returned {len(out)} scores for {len(completions)} completions"
    converted = [_to_score(x) for x in out]
    return [s for s, _ in converted], next((err for _, err in converted if err), None)


def _run_item(
    fn: Verifier, prompts: list[str], completions: list[str], columns: dict[str, list], i: int
) -> tuple[float, str | None]:
    try:
        out = list(fn(prompts=[prompts[i]], completions=[completions[i]], **{k: [c[i]] for k, c in columns.items()}))
    except Exception as e:
        return math.nan, repr(e)
    if len(out) != 1:
        return math.nan, f"returned {len(out)} scores for 1 completion"
    return _to_score(out[0])


def _to_score(x: Any) -> tuple[float, str | None]:
    """A finite float, or NaN with why (None is a declared 'cannot score', so it carries no error)."""
    if x is None:
        return math.nan, None
    if isinstance(x, (str, bytes)):
        return math.nan, f"returned a non-numeric score {x!r}"
    try:
        s = float(x)
    except (TypeError, ValueError) as e:
        return math.nan, repr(e)
    if not math.isfinite(s) or abs(s) > FLOAT32_MAX:
        return math.nan, f"returned a non-finite score {s} (float32 holds at most {FLOAT32_MAX:.3g})"
    return s, None
