"""The `tiny-multiturn` task: single-digit sums with a TRL-style environment the policy may call.

`SumEnv` is written the way TRL's documentation writes an `environment_factory` class: a no-argument constructor,
`reset(**row)` taking the data row's columns (here `answer`), one public method per tool with type hints and an
Args section, and the reward kept on the instance for reward functions to read (`environments=`). `check` tells the
model whether a guess is right, so a policy that calls it can answer correctly on its next turn.
"""

from __future__ import annotations


class SumEnv:
    def __init__(self):
        self.answer = ""
        self.reward = 0.0
        self.checks = 0

    def reset(self, **kwargs) -> str | None:
        self.answer, self.reward, self.checks = str(kwargs["answer"]).strip(), 0.0, 0
        return None

    def check(self, guess: int) -> str:
        """Check whether a guess is the sum.

        Args:
            guess: the proposed sum
        """
        self.checks += 1
        right = str(guess).strip() == self.answer
        self.reward = max(self.reward, float(right))
        return "right" if right else "wrong"


def sum_reward(completions: list, environments: list | None = None, **kwargs) -> list[float | None]:
    """TRL-style reward function reading the episodes' environments: 1 for the environment's answer as the final
    reply, 0.5 for another single digit, else 0; None without environments (a single-turn caller).

    >>> env = SumEnv(); _ = env.reset(answer="7")
    >>> sum_reward(["7", "5", "x"], [env, env, env])
    [1.0, 0.5, 0.0]
    """
    if environments is None:
        return [None] * len(completions)
    out = []
    for text, env in zip(completions, environments, strict=True):
        final = text.strip().rsplit("</tool_response>", 1)[-1].strip()
        out.append(1.0 if final == env.answer else 0.5 if len(final) == 1 and final.isdigit() else 0.0)
    return out
