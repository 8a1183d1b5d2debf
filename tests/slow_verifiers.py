"""Verifiers used by tests through the import-path mechanism ("tests.slow_verifiers:slow_math")."""

import time

from forge.rewards.verifiers import math_answer


def slow_math(prompts, completions, answer, **kwargs):
    """math_answer that takes a while, so a test can kill a run between steps."""
    time.sleep(0.4)
    return math_answer(prompts, completions, answer=answer)
