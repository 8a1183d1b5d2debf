"""Split a rollout batch across N rollout replicas in proportion to their measured throughput.

Each replica's speed is an exponential moving average of the tokens/s it reported (`observe`):
`speed = alpha * measured + (1 - alpha) * speed`, except that a replica's first report replaces the starting
guess outright (the guess is in arbitrary units; averaging it in would take many steps to wash out). A replica
with no report yet is assumed as fast as the mean of those that have one; before any report all are equal.

`split(n)` gives replica i `n * speed_i / sum(speed)` prompts, rounded by largest remainder (floors first, the
leftover one by one to the largest fractional parts, ties to the lower index), so the sizes sum to n. Giving each
replica work in proportion to its speed makes them finish together: the step's makespan is then close to
n / sum(speed), the best any split can do. A replica measured at 0 tokens/s gets nothing until a later
`observe` (e.g. a health check) raises its speed again.
"""

from __future__ import annotations

import math
from typing import Any


class ThroughputBalancer:
    def __init__(self, replicas: int, alpha: float = 0.3):
        if replicas < 1 or not 0 < alpha <= 1:
            raise ValueError(f"ThroughputBalancer: need replicas >= 1 and 0 < alpha <= 1, got {replicas}, {alpha}")
        self.alpha = alpha
        self._speeds: list[float | None] = [None] * replicas  # tokens/s; None = not measured yet

    @property
    def speeds(self) -> list[float]:
        """Current tokens/s estimate per replica (unmeasured ones at the measured mean, or 1.0 when none is)."""
        known = [s for s in self._speeds if s is not None]
        guess = sum(known) / len(known) if known else 1.0
        return [guess if s is None else s for s in self._speeds]

    def split(self, n: int) -> list[int]:
        """Sizes summing to n, proportional to the speeds (largest-remainder rounding), each >= 0."""
        if n < 0:
            raise ValueError(f"split: n must be >= 0, got {n}")
        speeds = self.speeds
        total = sum(speeds)
        shares = [n * s / total for s in speeds] if total > 0 else [n / len(speeds)] * len(speeds)
        sizes = [math.floor(x) for x in shares]
        by_remainder = sorted(range(len(sizes)), key=lambda i: (-(shares[i] - sizes[i]), i))
        for i in by_remainder[: n - sum(sizes)]:
            sizes[i] += 1
        return sizes

    def observe(self, replica: int, tokens: int, seconds: float) -> None:
        """Record that `replica` produced `tokens` in `seconds` of wall time."""
        if not 0 <= replica < len(self._speeds) or tokens < 0 or seconds <= 0:
            raise ValueError(
                f"observe: need 0 <= replica < {len(self._speeds)}, tokens >= 0, seconds > 0; "
                f"got {replica}, {tokens}, {seconds}"
            )
        measured = tokens / seconds
        old = self._speeds[replica]
        self._speeds[replica] = measured if old is None else self.alpha * measured + (1 - self.alpha) * old

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "speeds": list(self._speeds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["speeds"]) != len(self._speeds):
            raise ValueError(
                f"load_state_dict: state has {len(state['speeds'])} replicas, this balancer {len(self._speeds)}"
            )
        self.alpha = float(state["alpha"])
        self._speeds = [None if s is None else float(s) for s in state["speeds"]]
