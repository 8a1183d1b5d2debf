r"""Label-free weak verifiers: they never read the reference answer column.

Each is noisy on its own; the ensemble (`forge.rewards.ensemble`) learns how far to trust each one.

- `group_agreement`: share of the other samples for the same prompt that reach the same final answer
  (self-consistency as a score; a popular wrong answer fools it).
- `concise`: shorter completions score higher (a length prior; biased, on purpose weak).

Task-specific weak checks live with their task: the arithmetic structure checks (`parity_check`, `residue3_check`,
`residue5_check`, `magnitude_check`) are in forge.tasks.arith; the registry resolves their names there, and the
old import paths `forge.rewards.weak:<check>` still work.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from forge.rewards.math import extract_answer
from forge.rewards.verifiers import takes_text


@takes_text
def group_agreement(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """Share of the other completions of the same prompt with the same final answer (0 when it has none).

    >>> group_agreement(["p"] * 4, ["7", "7", "8", "7"])
    [0.6666666666666666, 0.6666666666666666, 0.0, 0.6666666666666666]
    """
    answers = [extract_answer(c) for c in completions]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        groups[p].append(i)
    scores: list[float | None] = [None] * len(completions)
    for members in groups.values():
        counts = Counter(answers[i] for i in members if answers[i] is not None)
        for i in members:
            if len(members) > 1:
                scores[i] = (counts[answers[i]] - 1) / (len(members) - 1) if answers[i] is not None else 0.0
    return scores


@takes_text
def concise(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1 / (1 + characters / 20): a weak prior that short, direct answers are right.

    >>> concise(["p", "p"], ["", "x" * 20])
    [1.0, 0.5]
    """
    return [1.0 / (1.0 + len(c.strip()) / 20.0) for c in completions]


WEAK = {
    "group_agreement": group_agreement,
    "concise": concise,
}
"""The generic weak verifiers by built-in name; task-specific checks live with their task (forge.tasks)."""

_MOVED = ("parity_check", "residue3_check", "residue5_check", "magnitude_check")


def __getattr__(name: str) -> Any:
    """The arithmetic checks moved to forge.tasks.arith; `forge.rewards.weak:parity_check` (an import path in a
    config or a run's saved config) still resolves to them."""
    if name in _MOVED:
        from forge.tasks import arith

        return getattr(arith, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
