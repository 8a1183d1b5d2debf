r"""Built-in verifiers, in the TRL reward-function convention.

A verifier is called as `fn(prompts=[...], completions=[...], **columns)` with one entry per completion in every
list (columns are data columns such as `answer`), and returns one score per completion, or None where it cannot
score an item. It must accept and ignore columns it does not use (`**kwargs`). Weights live in `RewardConfig`.

The built-ins are marked `takes_text`: whatever the data's prompts are (strings or chat messages), they get the
prompts as the model saw them and plain-text completions. Unmarked verifiers (yours, TRL's) get TRL's convention
(`forge.rewards.score`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from forge.rewards.math import NUMBER_PATTERN, completion_matches

Verifier = Callable[..., Sequence[float | None]]
"""(prompts: list[str], completions: list[str], **columns: list) -> one float or None per completion."""

TEXT_ATTR = "forgeweave_takes_text"


def takes_text(fn: Callable) -> Callable:
    """Mark a verifier as wanting text: prompts as the model saw them (template applied) and completions as
    strings, also when the data's prompts are chat messages. Returns fn."""
    setattr(fn, TEXT_ATTR, True)
    return fn


def wants_text(fn: Callable) -> bool:
    """Whether fn was marked with `takes_text` (a function, or an object whose class sets the attribute)."""
    return getattr(fn, TEXT_ATTR, False) is True


_INTEGER = re.compile(r"[+-]?\d+")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@takes_text
def math_answer(prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any) -> list[float | None]:
    r"""1.0 when the completion's final answer matches the reference, else 0.0; None where the reference is missing.

    Plain numbers are compared by the fast path, anything else by math-verify (`completion_matches`).

    >>> math_answer(["1+1?", "1+1?", "1+1?"], [r"so \boxed{2}", "It is 3.", "2"], answer=["2", "2", None])
    [1.0, 0.0, None]
    """
    return [
        None if ref is None else float(completion_matches(text, str(ref)))
        for text, ref in zip(completions, answer, strict=True)
    ]


@takes_text
def format_integer(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 for a bare integer, 0.5 for exactly one number with at most 3 other words, else 0.0.

    >>> format_integer(["q"] * 4, [" -12 ", "The sum is 12.", "12 or 13", "twelve"])
    [1.0, 0.5, 0.0, 0.0]
    """
    return [_integer_format_score(text) for text in completions]


def _integer_format_score(text: str) -> float:
    text = text.strip()
    if _INTEGER.fullmatch(text):
        return 1.0
    if len(NUMBER_PATTERN.findall(text)) != 1:
        return 0.0
    other_words = re.findall(r"\w+", NUMBER_PATTERN.sub(" ", text))
    return 0.5 if len(other_words) <= 3 else 0.0


@takes_text
def format_tags(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion holds exactly one non-empty `<answer>...</answer>`, else 0.0.

    >>> format_tags(["q"] * 3, ["<answer>7</answer>", "<answer>7</answer><answer>8</answer>", "<answer> </answer>"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _one_answer_tag(text) else 0.0 for text in completions]


def _one_answer_tag(text: str) -> bool:
    found = _TAGGED.findall(text)
    # an empty tag would pay for format alone, so it does not count
    return len(found) == 1 and text.count("<answer>") == text.count("</answer>") == 1 and bool(found[0].strip())


BUILTIN: dict[str, Verifier] = {
    "math_answer": math_answer,
    "format_integer": format_integer,
    "format_tags": format_tags,
}
