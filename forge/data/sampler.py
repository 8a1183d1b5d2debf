"""Deterministic prompt order for training: row i of the endless order is a pure function of (seed, i).

Epoch e visits the rows in the permutation seeded by (seed, e); `prompt_batch(rows, seed, start, n)` is rows
start..start+n-1 of that order, so a step's prompts are derived from (seed, step) as its rollout seed is, and nothing
is carried: the loop asks for step t's batch at index `offset + (t - 1) * B` (the offset is 0 unless a resumed run
changed the batch size B). A checkpoint records the next row as (epoch, cursor) (`sampler_state`), the format the
earlier stateful sampler wrote, so old checkpoints resume unchanged.
"""

from __future__ import annotations

import functools

import numpy as np

from forge.errors import UserError


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, count: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(count)


def prompt_batch(rows: list[dict], seed: int, start: int, n: int) -> list[dict]:
    """Rows start..start+n-1 (copies) of the endless order; a batch repeats a row only if n > len(rows).

    >>> rows = [{"id": i} for i in range(3)]
    >>> epoch0 = [r["id"] for r in prompt_batch(rows, 7, 0, 3)]
    >>> sorted(epoch0), [r["id"] for r in prompt_batch(rows, 7, 1, 2)] == epoch0[1:]
    ([0, 1, 2], True)
    """
    if not rows:
        raise ValueError("prompt_batch needs at least one row")
    if n < 0 or start < 0:
        raise ValueError(f"start and n must be >= 0, got {start}, {n}")
    count = len(rows)
    return [dict(rows[_permutation(seed, i // count, count)[i % count]]) for i in range(start, start + n)]


def sampler_state(seed: int, num_rows: int, next_row: int) -> dict:
    """The checkpoint's record of the prompt order: the next row to draw as (epoch, cursor), JSON-ready."""
    return {"epoch": next_row // num_rows, "cursor": next_row % num_rows, "seed": seed, "num_rows": num_rows}


def next_row(state: dict, num_rows: int) -> int:
    """The index of the next row a checkpoint's `sampler_state` names; raises UserError if it was saved for a
    different number of rows."""
    saved_rows = state.get("num_rows", num_rows)
    if saved_rows != num_rows:
        raise UserError(
            f"sampler state is for {saved_rows} training rows but the data has {num_rows}; "
            "resume with the run's own data/train.parquet"
        )
    return int(state["epoch"]) * num_rows + int(state["cursor"])
