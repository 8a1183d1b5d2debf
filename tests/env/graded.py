"""A graded reward for multi-turn tests, by import path ("tests.env.graded:reward_func"); imports only the standard
library, so the rollout actors of either venv (the evaluation's mean reward) can load it."""

from __future__ import annotations

import re


def reward_func(completions, environments, **kwargs):
    """The environment's reward if the policy guessed right with its tool; else 1 for the environment's answer as
    the reply's last number, 0.25 for a reply with a digit in it, 0 otherwise."""
    out = []
    for text, env in zip(completions, environments, strict=True):
        numbers = re.findall(r"\d+", text.rsplit("</tool_response>", 1)[-1])
        graded = 1.0 if numbers and numbers[-1] == env.answer else 0.25 if numbers else 0.0
        out.append(max(env.reward, graded))
    return out
