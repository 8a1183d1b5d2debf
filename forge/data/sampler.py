"""Deterministic prompt order for training: `PromptSampler` draws rows in a seeded permutation per epoch.

Its state is two integers (epoch, cursor), so a resumed run continues with exactly the batches it would have drawn.
"""

from __future__ import annotations

import numpy as np

from forge.errors import UserError


class PromptSampler:
    """Endless deterministic sampler: epoch e visits the rows in the permutation seeded by (seed, e).

    The state is (epoch, cursor) plus the seed and row count it applies to, so `load_state_dict` restores exactly
    the future sequence without replaying the past.
    """

    def __init__(self, rows: list[dict], seed: int) -> None:
        if not rows:
            raise ValueError("PromptSampler needs at least one row")
        self._rows = list(rows)
        self._seed = seed
        self._epoch = 0
        self._cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._rows))

    def next_batch(self, n: int) -> list[dict]:
        """The next n rows (copies), crossing epoch boundaries; a batch can repeat a row only if n > len(rows)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch = []
        while len(batch) < n:
            if self._cursor == len(self._rows):
                self._epoch, self._cursor = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            take = min(n - len(batch), len(self._rows) - self._cursor)
            batch += [dict(self._rows[i]) for i in self._order[self._cursor : self._cursor + take]]
            self._cursor += take
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self._seed, "num_rows": len(self._rows)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict; raises UserError if it was saved for a different number of rows."""
        saved_rows = state.get("num_rows", len(self._rows))
        if saved_rows != len(self._rows):
            raise UserError(
                f"sampler state is for {saved_rows} training rows but the data has {len(self._rows)}; "
                "resume with the run's own data/train.parquet"
            )
        self._seed, self._epoch, self._cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self._epoch)
