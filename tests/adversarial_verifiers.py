"""An adversarial reward for the collapse-guard tests (tests/test_guard.py), used through its import path.

`flip` plays a label-free reward that gets gamed. It computes the true sum of an "a+b=" prompt itself (with
reward.label_free the answer column is hidden from it) and, until global step `SWITCH`, pays 0.5 for it and nothing
else. From then on it pays 1.0 for the fixed wrong answer `WRONG` and 0.75 for any other wrong number (shaping, so
that the tiny policy finds WRONG within a few steps), still 0.5 for the true sum. The policy leaves the truth for
wrong answers: held-out accuracy falls to 0 while the reward rises -- what the collapse guard must catch.
"""

import re

SWITCH = 10  # TRL's global_step (updates done) from which wrong answers pay more than the true one
WRONG = "4"
OTHER_WRONG = 0.75
_PROBLEM = re.compile(r"(\d+)\s*\+\s*(\d+)")
_NUMBER = re.compile(r"\d+")


def flip(prompts, completions, **kwargs):
    """0.5 for the true sum; from global step SWITCH on, 1.0 for WRONG and 0.75 for another wrong number.

    >>> class State: global_step = 0
    >>> flip(["2+3="] * 4, ["5", "4", "7", "x"], trainer_state=State())
    [0.5, 0.0, 0.0, 0.0]
    >>> State.global_step = SWITCH
    >>> flip(["2+3="] * 4, ["5", "4", "7", "x"], trainer_state=State())
    [0.5, 1.0, 0.75, 0.0]
    """
    state = kwargs.get("trainer_state")  # evaluation passes none: it scores as before SWITCH
    late = state is not None and state.global_step >= SWITCH
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        a, b = map(int, _PROBLEM.search(prompt).groups())
        found = _NUMBER.findall(completion)
        answer = found[-1] if found else None
        if answer == str(a + b) or answer is None or not late:
            scores.append(0.5 if answer == str(a + b) else 0.0)
        else:
            scores.append(1.0 if answer == WRONG else OTHER_WRONG)
    return scores
