"""The `smollm2-multiturn` task: 2-digit addition where a wrong reply gets feedback and another try.

SmolLM2-135M-Instruct does not call tools, so this environment talks to plain replies instead: `on_reply` (the
episode loop's feedback hook, `forge.env.episode.REPLY_HOOK`) reads the reply's final number like `math_answer`
does and answers a wrong one with whether it is too high or too low (a reply without a number: what to reply
with), so a later turn can succeed where the first failed; a right one, or the last turn (`env.max_turns`), ends
the episode. The reward (`reward`, read by the built-in `env_reward`) is 1 once a reply is right, so the run
optimises final-turn success; eval reports the first and the final turn apart (`eval/first_turn@1`,
`eval/final_turn@1`). The class follows TRL's environment contract otherwise (no-argument constructor,
`reset(**row)`); it has no tools.
"""

from __future__ import annotations

import re

from forge.rewards.math import extract_answer

HINT = "Wrong. Hint: {a} + {b} = {partial} + {units}. Reply with only the final integer."
REVEAL = "Wrong. The answer is {answer}. Reply with only the final integer."
NO_NUMBER = "Reply with only the final integer."
_OPERANDS = re.compile(r"(\d+) \+ (\d+)")


class RetryArithEnv:
    reveal_after = 2  # wrong replies after which the feedback gives the answer (None: never, the hint only)

    def __init__(self):
        self.answer = 0
        self.operands = (0, 0)
        self.reward = 0.0
        self.guesses: list[int | None] = []

    def reset(self, **kwargs) -> str | None:
        self.answer, self.reward, self.guesses = int(str(kwargs["answer"]).strip()), 0.0, []
        found = _OPERANDS.search(str(kwargs.get("prompt", "")))
        self.operands = (int(found[1]), int(found[2])) if found else (self.answer, 0)
        return None

    def on_reply(self, reply: str) -> str | None:
        """Feedback on a reply: None when it is right (the episode ends), else a hint that leaves one easy step, and
        from the `reveal_after`-th wrong reply on the answer itself (a number the policy is told, as a tool would).

        >>> env = RetryArithEnv(); _ = env.reset(prompt="Compute 27 + 82.", answer="109")
        >>> env.on_reply("100")
        'Wrong. Hint: 27 + 82 = 107 + 2. Reply with only the final integer.'
        >>> env.on_reply("107")[:25], env.on_reply("It is 109."), env.reward
        ('Wrong. The answer is 109.', None, 1.0)
        """
        guess = _integer(reply)
        self.guesses.append(guess)
        if guess is None:
            return NO_NUMBER
        if guess == self.answer:
            self.reward = 1.0
            return None
        wrong = len(self.guesses) - self.guesses.count(None)
        if self.reveal_after is not None and wrong >= self.reveal_after:
            return REVEAL.format(answer=self.answer)
        a, b = self.operands
        return HINT.format(a=a, b=b, partial=a + b - b % 10, units=b % 10)


class HintOnlyEnv(RetryArithEnv):
    """The same task without the answer ever given: every wrong reply gets the decomposition hint."""

    reveal_after = None


def _integer(reply: str) -> int | None:
    """The reply's final answer as an integer (None: no integer).

    >>> _integer("The sum is 12."), _integer("12.5"), _integer("none")
    (12, None, None)
    """
    pred = extract_answer(reply)
    try:
        return int(str(pred).strip().replace(",", "")) if pred is not None else None
    except ValueError:
        return None
