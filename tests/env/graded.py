"""A graded reward for multi-turn tests, by import path ("tests.env.graded:reward_func"); imports only the standard
library, so the rollout actors of either venv (the evaluation's mean reward) can load it."""

from __future__ import annotations

import re


def reward_func(completions, environments, answer, **kwargs):
    """The environment's reward if the policy guessed right with its tool (an OpenEnv server's, or a `SumEnv`'s);
    else 1 for the row's answer as the reply's last number, 0.25 for a reply with a digit in it, 0 otherwise."""
    out = []
    for text, env, want in zip(completions, environments, answer, strict=True):
        numbers = re.findall(r"\d+", text.rsplit("</tool_response>", 1)[-1])
        graded = 1.0 if numbers and numbers[-1] == str(want) else 0.25 if numbers else 0.0
        out.append(max(env.reward or 0.0, graded))
    return out


def own_row(completions, environments, answer, **kwargs):
    """1 where the episode's environment was reset with its own row's answer (`SumEnv.answer`), else 0: an eval
    verifier that tells whether each episode played its own row, whatever the model replied."""
    return [float(str(getattr(env, "answer", None)) == str(want)) for env, want in zip(environments, answer,
                                                                                         strict=True)]  # fmt: skip
