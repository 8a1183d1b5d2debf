"""The reward stage: run every verifier on a batch of completions and combine the scores by weight.

A verifier is called once on the whole batch, by keyword, the way TRL's GRPOTrainer calls a reward function:
`prompts=`, `completions=`, `completion_ids=` (the completion's token ids, no padding), `trainer_state=` (when
the caller has them) and every data column with its own type. What `prompts` and `completions` hold depends on
the verifier: one marked text-only (`forge.rewards.verifiers.takes_text`: the built-ins) gets the prompts as
the model saw them and the completions as strings; any other gets TRL's convention: the data's own prompts
(strings, or lists of chat messages), and for a conversational prompt each completion as
`[{"role": "assistant", "content": text}]` (strings otherwise). So TRL reward functions work unchanged.

If the batch call raises, the verifier is called again item by item so one bad item does not void the batch.
Items it raised on, returned None for, or scored with a non-finite or non-numeric value get NaN and are counted
as failures; a result of the wrong length fails every item. Items it raised on or scored with a bad value are
also counted as errors (None is a declared "cannot score", not an error), and its first error text is kept.
None of this is fatal here: the loop shows the errors and stops a run whose verifier fails on every item for
`reward.max_failing_steps` steps (`forge.metrics.failing_in_a_row`).

Reward = sum_v w_v * score_v with NaN counted as 0, so a missing score is neither rewarded nor excluded. A score
beyond float32's range is a failure too, and a weighted sum that overflows is 0: nothing non-finite reaches the
advantages.

Time budget (`reward.score_timeout_s`): each verifier's work on a batch runs in a daemon thread; if it is not done
in time the stage raises a `VerifierTimeout` (a UserError naming the verifier) and the run stops, resumable from its
last checkpoint. We stop rather than count the items as failures because a Python thread cannot be killed: a hung
verifier would keep running (and holding the GIL) beside the training it was meant to score.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.errors import UserError
from forge.rewards.verifiers import Verifier, wants_text

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
    errored: dict[str, int] = field(default_factory=dict)  # verifier name -> items it raised on or scored badly


def score_completions(
    verifiers: list[tuple[str, Verifier]],
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    timeout_s: float = 0.0,
    *,
    raw_prompts: list | None = None,
    completion_ids: list[list[int]] | None = None,
    trainer_state: Any = None,
    environments: list | None = None,
) -> RewardResult:
    """Score N completions with V verifiers. prompts (the model's input text), raw_prompts (the data's prompts,
    strings or message lists; None = `prompts`), completion_ids and every column hold one entry per completion;
    completion_ids, trainer_state and environments (one per completion) are passed on only when given. Each
    verifier gets `timeout_s` seconds for the batch (0 = no limit), else VerifierTimeout."""
    n = len(completions)
    names = [name for name, _ in verifiers]
    _check_inputs(names, weights, prompts, completions, columns)
    trl_prompts = prompts if raw_prompts is None else raw_prompts
    assert len(trl_prompts) == n, f"{len(trl_prompts)} raw prompts for {n} completions"
    lists = dict(columns) if completion_ids is None else {**columns, "completion_ids": completion_ids}
    if environments is not None:  # multi-turn: each episode's environment, as TRL passes `environments=`
        lists["environments"] = environments
    fixed = {} if trainer_state is None else {"trainer_state": trainer_state}
    w = torch.tensor(list(weights) if weights else [1.0] * len(verifiers), dtype=torch.float32)  # [V]
    scores = torch.full((n, len(verifiers)), math.nan, dtype=torch.float32)  # [N, V]
    failures: dict[str, int] = {}
    errored: dict[str, int] = {}
    errors: dict[str, str] = {}
    for v, (name, fn) in enumerate(verifiers):
        p, c = (prompts, completions) if wants_text(fn) else (trl_prompts, trl_completions(trl_prompts, completions))
        call = _Call(fn, p, c, lists, fixed)
        column, error, bad = _within(timeout_s, name, lambda call=call: _run_verifier(call))
        scores[:, v] = torch.tensor(column, dtype=torch.float32)
        failures[name] = sum(math.isnan(s) for s in column)
        errored[name] = bad
        if error is not None:
            errors[name] = error
    rewards = (scores.double().nan_to_num(nan=0.0) * w.double()).sum(dim=1)  # [N]; float64: no overflow here
    rewards = torch.where(rewards.abs() <= FLOAT32_MAX, rewards, 0.0).float()  # a sum past float32's range: 0
    return RewardResult(names, scores, rewards, failures, errors, errored)


def unscored(result: RewardResult, failed: torch.Tensor) -> RewardResult:
    """`result` without the scores of the items `failed` [N] marks (episodes whose environment failed): NaN scores,
    counted as failures of every verifier, reward 0.

    >>> r = RewardResult(["v"], torch.tensor([[1.0], [0.5]]), torch.tensor([1.0, 0.5]), {"v": 0}, {})
    >>> u = unscored(r, torch.tensor([False, True]))
    >>> u.scores[:, 0].tolist(), u.rewards.tolist(), u.failures
    ([1.0, nan], [1.0, 0.0], {'v': 1})
    """
    scores = result.scores.masked_fill(failed.unsqueeze(1), math.nan)  # [N, V]
    failures = {name: int(scores[:, v].isnan().sum()) for v, name in enumerate(result.names)}
    return dataclasses.replace(result, scores=scores, rewards=result.rewards.masked_fill(failed, 0.0),
                               failures=failures)  # fmt: skip


def trl_completions(prompts: list, completions: list[str]) -> list:
    """TRL's completions: `[{"role": "assistant", "content": text}]` where the prompt is a message list, else text.

    >>> trl_completions(["2+2=", [{"role": "user", "content": "2+2="}]], ["4", "4"])
    ['4', [{'role': 'assistant', 'content': '4'}]]
    """
    return [
        [{"role": "assistant", "content": c}] if isinstance(p, list) else c
        for p, c in zip(prompts, completions, strict=True)
    ]


@dataclass(frozen=True)
class _Call:
    """One verifier's arguments for a batch: per-item lists (sliced for the item-by-item retry) and fixed values."""

    fn: Verifier
    prompts: list
    completions: list
    lists: dict[str, list]  # data columns (and completion_ids): one entry per completion
    fixed: dict[str, Any]  # trainer_state: the same for every item

    def __call__(self, i: int | None = None) -> Any:
        if i is None:
            return self.fn(prompts=self.prompts, completions=self.completions, **self.lists, **self.fixed)
        items = {k: [col[i]] for k, col in self.lists.items()}
        return self.fn(prompts=[self.prompts[i]], completions=[self.completions[i]], **items, **self.fixed)


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


RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")
"""Verifier arguments a data column may not be named after."""


def _check_inputs(
    names: list[str], weights: list[float] | None, prompts: list[str], completions: list[str], columns: dict
) -> None:
    if weights and len(weights) != len(names):
        raise UserError(f"reward.weights has {len(weights)} values for {len(names)} verifiers; give one per verifier")
    for key in RESERVED:
        if key in columns:
            raise UserError(f"data column '{key}' clashes with the verifier argument of that name; rename the column")
    assert len(set(names)) == len(names), f"verifier names must be unique, got {names}"
    assert len(prompts) == len(completions), f"{len(prompts)} prompts for {len(completions)} completions"
    for key, col in columns.items():
        assert len(col) == len(completions), f"column '{key}' has {len(col)} entries for {len(completions)} items"


def _run_verifier(call: _Call) -> tuple[list[float], str | None, int]:
    """One score per item (NaN = failed), the first error message (if any) and how many items erred."""
    n = len(call.completions)
    try:
        out = list(call())
    except Exception as e:
        items = [_run_item(call, i) for i in range(n)]
        return [s for s, _ in items], repr(e), sum(err is not None for _, err in items)
    if len(out) != n:
        return [math.nan] * n, f"returned {len(out)} scores for {n} completions", n
    converted = [_to_score(x) for x in out]
    errs = [err for _, err in converted if err]
    return [s for s, _ in converted], next(iter(errs), None), len(errs)


def _run_item(call: _Call, i: int) -> tuple[float, str | None]:
    try:
        out = list(call(i))
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
