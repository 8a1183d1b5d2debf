"""`env_reward`: an episode's environment's own reward as a verifier (TRL reward-function convention)."""

from __future__ import annotations

from typing import Any


def env_reward(prompts: list, completions: list, environments: list | None = None, **kwargs: Any) -> list:
    """Each episode's environment `reward`: a method is called, a number read; None where there is none.

    >>> class Env:
    ...     reward = 1.0
    >>> env_reward(["q", "q"], ["a", "b"], environments=[Env(), None])
    [1.0, None]
    """
    if environments is None:
        return [None] * len(completions)
    out = []
    for env in environments:
        value = getattr(env, "reward", None)
        value = value() if callable(value) else value
        out.append(None if value is None else float(value))
    return out
