"""Two reward functions written for TRL's GRPOTrainer, used by forgeweave unchanged.

TRL calls a reward function with keyword arguments: `prompts`, `completions` (for a conversational dataset, each
completion is `[{"role": "assistant", "content": text}]`), `completion_ids`, `trainer_state` and every other
dataset column with its own type. Each returns one float per completion (None = cannot score).
"""

import re


def reward_format(completions, **kwargs):
    """1.0 when the reply is a bare integer, else 0.0 (reads the assistant message's content)."""
    return [1.0 if re.fullmatch(r"\s*-?\d+\s*", c[0]["content"]) else 0.0 for c in completions]


def reward_correct(completions, target, **kwargs):
    """1.0 when the reply equals the integer `target` column (an int: a string "7" would never equal 7)."""
    scores = []
    for completion, expected in zip(completions, target, strict=True):
        try:
            scores.append(1.0 if int(completion[0]["content"].strip()) == expected else 0.0)
        except ValueError:  # not an integer at all
            scores.append(0.0)
    return scores
