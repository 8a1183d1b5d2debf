r"""The arithmetic task: compute "a op b" for integers a, b and op in +, -, *; the answer is the integer result.

Generator: `generate_arithmetic(data_config, seed)` gives disjoint train/eval rows {"id", "prompt", "answer"} of
distinct problems, deterministic by seed (`data.source=arithmetic`, read by forge.data's prep stage; the `tiny*` and
`smollm2-arith*` presets). Its settings are data.digits, data.operations, data.min_operand, data.max_result,
data.allow_negative, data.prompt_template, data.train_size, data.eval_size and data.eval_overlap.

Checks (label-free: they read the prompt, never the answer column): `parity_check`, `residue3_check`,
`residue5_check` and `magnitude_check` test a necessary condition of the true result of the "a op b" found in the
prompt — parity, residue mod 3, residue mod 5, number of digits. Every correct answer passes; a wrong one passes by
chance (about 1/2, 1/3, 1/5 and often); a completion without an integer answer fails. They return None when the
prompt is not of that form. They are built-in verifier names (`CHECKS`, resolved by forge.rewards.registry).

Shipped files (`smollm2-arith-unlabeled`): 2-digit additions from this generator (seed 0, prompts as in
`smollm2-arith`), in three disjoint files under forge/tasks/:
- arith_unlabeled_train.jsonl: 2000 prompts and ids, no answer column (what a user without reference answers has);
- arith_eval.jsonl: 200 held-out problems with answers, for measurement only (eval pass@1);
- arith_probe.jsonl: 50 other held-out problems with answers, the collapse guard's probe (`collapse.probe_source`);
  never read by the reward.
`python -m forge.tasks.arith` rewrites them (`write_task_files`); a test checks they match.

Evaluation: pass@1 / pass@k with the `math_answer` verifier (forge/rewards/math.py): the completion's final number
equals the reference integer.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from forge.config_base import ConfigError
from forge.data.config import DataConfig
from forge.io import atomic_write_bytes
from forge.rewards.math import extract_answer
from forge.rewards.verifiers import Verifier, takes_text
from forge.tasks import TASKS_DIR, to_jsonl

_OPS: dict[str, Callable[[Any, Any], Any]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_MAX_DIGITS = 9  # a 9-digit product stays below 1e18, inside int64
_ENUMERATE_LIMIT = 1 << 22  # operand pairs x ops up to which every problem is enumerated (digits <= 3)
_SAMPLE_ROUNDS = 20  # above the limit, problems are drawn at random in this many rounds at most

Problem = tuple[int, int, int]  # (a, index into the op list, b)


# ---------------------------------------------------------------- generator


def generate_arithmetic(cfg: DataConfig, seed: int) -> tuple[list[dict], list[dict]]:
    """Return (train_rows, eval_rows) of {"id", "prompt", "answer"} arithmetic problems, deterministic by seed.

    A problem is an ordered (a, op, b); each appears at most once, so the splits are disjoint (note that 3+5 and
    5+3 are different problems and may land in different splits). Subtractions with a < b are skipped unless
    data.allow_negative (their swap is already in the space). When fewer problems exist than
    train_size + eval_size, all are used: eval gets min(eval_size, max(1, 25% of them)), train the rest (at most
    train_size); nothing is repeated. Up to 3 digits the space is enumerated; above, problems are drawn at random
    and a filter too strict to find enough of them is a ConfigError.

    >>> cfg = DataConfig(digits=1, train_size=2, eval_size=1, prompt_template="{a} {op} {b} =")
    >>> train, eval_ = generate_arithmetic(cfg, seed=0)
    >>> [r["prompt"] + " " + r["answer"] for r in train], eval_
    (['3 + 6 = 9', '2 + 0 = 2'], [{'id': 'arith-8+2', 'prompt': '8 + 2 =', 'answer': '10'}])
    """
    ops, lo, hi = _arith_space(cfg)
    need = cfg.train_size + cfg.eval_size
    rng = np.random.default_rng(seed)
    if (hi - lo + 1) ** 2 * len(ops) <= _ENUMERATE_LIMIT:
        problems = _enumerate_problems(cfg, ops, lo, hi, need, rng)
    else:
        problems = _sample_problems(cfg, ops, lo, hi, need, rng)
    if cfg.eval_overlap:
        # the whole space trains; eval is a seeded sample of the same space (tiny tasks: mastery, not generalisation)
        rows = [_arith_row(cfg, a, ops[k], b) for a, k, b in problems[: cfg.train_size]]
        picks = rng.permutation(len(problems))[: cfg.eval_size]
        return rows, [_arith_row(cfg, *_named(problems[i], ops)) for i in picks]
    n_eval, n_train = _split_sizes(len(problems), cfg)
    rows = [_arith_row(cfg, a, ops[k], b) for a, k, b in problems[: n_eval + n_train]]
    return rows[n_eval:], rows[:n_eval]


def _named(problem: Problem, ops: list[str]) -> tuple[int, str, int]:
    a, k, b = problem
    return a, ops[k], b


def _arith_space(cfg: DataConfig) -> tuple[list[str], int, int]:
    """Check the arithmetic settings; return (distinct ops, smallest operand, largest operand)."""
    ops = list(dict.fromkeys(cfg.operations))
    _check(bool(ops) and all(o in _OPS for o in ops), "data.operations", f"must list +, - or * (got {cfg.operations})")
    _check(1 <= cfg.digits <= _MAX_DIGITS, "data.digits", f"must be between 1 and {_MAX_DIGITS}")
    _check(cfg.train_size >= 1, "data.train_size", "must be >= 1")
    _check(cfg.eval_size >= 0, "data.eval_size", "must be >= 0")
    hi = 10**cfg.digits - 1
    lo = (0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)) if cfg.min_operand == -1 else cfg.min_operand
    _check(0 <= lo <= hi, "data.min_operand", f"must be -1 or between 0 and {hi} for digits={cfg.digits}")
    try:
        cfg.prompt_template.format(a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError):
        raise ConfigError(
            f"config key 'data.prompt_template' must only use the fields {{a}} {{op}} {{b}}, got "
            f"{cfg.prompt_template!r}"
        ) from None
    return ops, lo, hi


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {why}")


def _valid_mask(cfg: DataConfig, op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: which (a op b) are kept by data.allow_negative and data.max_result."""
    keep = np.ones(a.shape, dtype=bool)
    if op == "-" and not cfg.allow_negative:
        keep &= a >= b
    if cfg.max_result >= 0:
        keep &= _OPS[op](a, b) <= cfg.max_result
    return keep


def _enumerate_problems(
    cfg: DataConfig, ops: list[str], lo: int, hi: int, need: int, rng: np.random.Generator
) -> list[Problem]:
    """Every valid problem in a fixed order, then the first `need` of a seeded permutation (all if fewer)."""
    values = np.arange(lo, hi + 1, dtype=np.int64)
    a, b = np.repeat(values, len(values)), np.tile(values, len(values))
    parts = []
    for k, op in enumerate(ops):
        keep = _valid_mask(cfg, op, a, b)
        parts.append(np.stack([a[keep], np.full(int(keep.sum()), k), b[keep]], axis=1))  # [n_op, 3]
    table = np.concatenate(parts)  # [n, 3]
    return [tuple(p) for p in table[rng.permutation(len(table))[:need]].tolist()]


def _sample_problems(
    cfg: DataConfig, ops: list[str], lo: int, hi: int, need: int, rng: np.random.Generator
) -> list[Problem]:
    """Draw random valid problems until `need` distinct ones are found (first-drawn order)."""
    found: dict[Problem, None] = {}
    size = max(1024, 2 * need)
    for _ in range(_SAMPLE_ROUNDS):
        a, b = rng.integers(lo, hi + 1, size), rng.integers(lo, hi + 1, size)
        k = rng.integers(0, len(ops), size)
        keep = np.zeros(size, dtype=bool)
        for i, op in enumerate(ops):
            keep |= (k == i) & _valid_mask(cfg, op, a, b)
        for p in zip(a[keep].tolist(), k[keep].tolist(), b[keep].tolist(), strict=True):
            found[p] = None
            if len(found) == need:
                return list(found)
    raise ConfigError(
        f"data: found only {len(found)} of {need} arithmetic problems with digits={cfg.digits} and "
        f"max_result={cfg.max_result}; raise data.max_result or lower data.train_size/eval_size"
    )


def _split_sizes(available: int, cfg: DataConfig) -> tuple[int, int]:
    """(n_eval, n_train) for `available` distinct problems (see generate_arithmetic for the small-space rule)."""
    if available >= cfg.train_size + cfg.eval_size:
        return cfg.eval_size, cfg.train_size
    n_eval = min(cfg.eval_size, max(1, available // 4))
    n_train = min(cfg.train_size, available - n_eval)
    if n_train < 1:
        raise ConfigError(
            f"data: only {available} arithmetic problems match data.digits/operations/min_operand/"
            "max_result; relax them"
        )
    return n_eval, n_train


def _arith_row(cfg: DataConfig, a: int, op: str, b: int) -> dict:
    prompt = cfg.prompt_template.format(a=a, op=op, b=b)
    return {"id": f"arith-{a}{op}{b}", "prompt": prompt, "answer": str(_OPS[op](a, b))}


# ---------------------------------------------------------------- label-free checks

_PROBLEM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")


def _structural(prompts: list[str], completions: list[str], same: Callable[[int, int], bool]) -> list[float | None]:
    """same(true result, guessed integer) per completion; None where the prompt holds no "a op b"."""
    out: list[float | None] = []
    for p, c in zip(prompts, completions, strict=True):
        m = _PROBLEM.search(p)
        guess = extract_answer(c)
        if m is None:
            out.append(None)  # not an "a op b" prompt: this check cannot say anything
        elif guess is None or not re.fullmatch(r"-?\d+", guess):
            out.append(0.0)  # no integer answer at all
        else:
            out.append(float(same(_OPS[m.group(2)](int(m.group(1)), int(m.group(3))), int(guess))))
    return out


@takes_text
def parity_check(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer has the parity of the true result of "a op b" in the prompt.

    >>> parity_check(["3+4="] * 3, ["7", "9", "8"])
    [1.0, 1.0, 0.0]
    """
    return _structural(prompts, completions, lambda t, g: t % 2 == g % 2)


@takes_text
def residue3_check(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer is congruent to the true result mod 3 (casting out threes).

    >>> residue3_check(["3+4="] * 3, ["7", "10", "8"])
    [1.0, 1.0, 0.0]
    """
    return _structural(prompts, completions, lambda t, g: t % 3 == g % 3)


@takes_text
def residue5_check(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer ends like the true result mod 5 (0/5, 1/6, ...): a wrong answer passes about 1 in 5.

    >>> residue5_check(["3+4="] * 3, ["7", "12", "8"])
    [1.0, 1.0, 0.0]
    """
    return _structural(prompts, completions, lambda t, g: t % 5 == g % 5)


@takes_text
def magnitude_check(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer has as many digits (and the same sign) as the true result.

    >>> magnitude_check(["3+4="] * 3, ["7", "1", "17"])
    [1.0, 1.0, 0.0]
    """
    return _structural(prompts, completions, lambda t, g: len(str(t)) == len(str(g)))


CHECKS: dict[str, Verifier] = {
    "parity_check": parity_check,
    "residue3_check": residue3_check,
    "residue5_check": residue5_check,
    "magnitude_check": magnitude_check,
}
"""The task's built-in verifier names (forge.rewards.registry resolves them after the generic weak verifiers)."""


# ---------------------------------------------------------------- shipped files (smollm2-arith-unlabeled)

TRAIN_FILE = TASKS_DIR / "arith_unlabeled_train.jsonl"
EVAL_FILE = TASKS_DIR / "arith_eval.jsonl"
PROBE_FILE = TASKS_DIR / "arith_probe.jsonl"
TRAIN_SIZE, EVAL_SIZE, PROBE_SIZE = 2000, 200, 50


def generate() -> tuple[list[dict], list[dict], list[dict]]:
    """(train rows without answers, eval rows, probe rows): disjoint 2-digit additions."""
    dc = DataConfig(digits=2, operations=["+"], train_size=TRAIN_SIZE, eval_size=EVAL_SIZE + PROBE_SIZE)
    train, held_out = generate_arithmetic(dc, seed=0)
    unlabeled = [{"id": r["id"], "prompt": r["prompt"]} for r in train]
    return unlabeled, held_out[:EVAL_SIZE], held_out[EVAL_SIZE:]


def write_task_files() -> None:
    """Rewrite the three shipped files from `generate`."""
    for path, rows in zip((TRAIN_FILE, EVAL_FILE, PROBE_FILE), generate(), strict=True):
        atomic_write_bytes(path, to_jsonl(rows))


if __name__ == "__main__":
    write_task_files()
