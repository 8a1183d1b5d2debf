r"""Label-free weak verifiers: they never read the reference answer column.

Each is noisy on its own; the ensemble (`forge.rewards.ensemble`) learns how far to trust each one.

- `group_agreement`: share of the other samples for the same prompt that reach the same final answer
  (self-consistency as a score; a popular wrong answer fools it).
- `concise`: shorter completions score higher (a length prior; biased, on purpose weak).
- Arithmetic structure checks for prompts of the form "a op b": `parity_check`, `residue3_check` and
  `residue5_check` and `magnitude_check` test a necessary condition of the true result computed from the prompt —
  parity, residue mod 3, residue mod 5, number of digits. Every correct answer passes; a wrong one passes by chance (about 1/2, 1/3, 1/5 and often);
  a completion without an integer answer fails. They return None when the prompt is not of that form.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from forge.rewards.math import extract_answer
from forge.rewards.verifiers import takes_text

_PROBLEM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


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


def _structural(prompts: list[str], completions: list[str], same) -> list[float | None]:
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


WEAK = {
    "group_agreement": group_agreement,
    "concise": concise,
    "parity_check": parity_check,
    "residue3_check": residue3_check,
    "residue5_check": residue5_check,
    "magnitude_check": magnitude_check,
}
