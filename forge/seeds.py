"""Seeds derived from (run seed, step, what), never carried: a retried, resumed or recovered step draws exactly what
the uninterrupted run drew, wherever it runs (in-process, a Ray actor, another replica count)."""

from __future__ import annotations

import zlib

import numpy as np

PURPOSES = {"rollout": 0, "update": 1}  # one stream of seeds per purpose


def derived_seed(seed: int, step: int, what: str = "rollout", rank: int = 0) -> int:
    """A 31-bit seed for `what` (rollout sampling; the update's dropout on rank `rank`) at `step` of a run seeded
    `seed`: numpy's SeedSequence over (seed, purpose, step, rank), the standard way to spawn independent streams.

    >>> derived_seed(0, 1) == derived_seed(0, 1) != derived_seed(0, 2)
    True
    """
    purpose = PURPOSES.get(what, zlib.crc32(what.encode()))
    return int(np.random.SeedSequence([seed, purpose, step, rank]).generate_state(1)[0]) & 0x7FFFFFFF
