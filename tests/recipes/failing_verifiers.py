"""Verifiers that raise, used by tests/recipes/test_verifier_errors.py through import paths."""


def picky(prompts, completions, **kwargs):
    """Scores completions that start with a digit; raises on every other one (TRL would crash on it)."""
    scores = []
    for c in completions:
        if not c[:1].isdigit():
            raise ValueError("picky cannot score a reply that does not start with a digit")
        scores.append(1.0)
    return scores


def broken(prompts, completions, **kwargs):
    """Always raises: the kind of bug that would otherwise train at reward 0 and exit 0."""
    return [c[0]["content"] for c in completions]  # a TRL chat reward given string completions
