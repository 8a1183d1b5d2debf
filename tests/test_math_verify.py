"""math_answer with math-verify: agreement on our own cases, the unchanged fast path, bounded work off the main thread."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from forge.rewards import math as fmath
from forge.rewards import mathverify
from forge.rewards.math import answers_match, completion_matches, extract_answer, is_plain_number
from forge.rewards.verifiers import math_answer
from tests.math_answer_cases import CASES

# measured on tests/math_answer_cases.py (191 cases): math-verify + fast path 0.979, the old checker 0.759.
# Per category, the agreement the new checker reaches; a drop in any one fails the test.
EXPECTED = {cat: 1.0 for cat, *_ in CASES} | {"hard": 8 / 12}


def _agreement(check) -> tuple[float, dict[str, float]]:
    hits, totals = Counter(), Counter()
    for cat, gold, completion, expected in CASES:
        totals[cat] += 1
        hits[cat] += check(completion, gold) == expected
    return sum(hits.values()) / len(CASES), {c: hits[c] / totals[c] for c in totals}


def test_agreement_with_expected_verdicts_overall_and_per_category():
    assert len(CASES) >= 150 and len({c for c, *_ in CASES}) >= 15
    overall, per_cat = _agreement(completion_matches)
    old_overall, old_cat = _agreement(lambda c, g: answers_match(extract_answer(c), g))
    for cat in per_cat:
        print(f"{cat:12s} new {per_cat[cat]:.2f}  old {old_cat[cat]:.2f}")
    print(f"overall      new {overall:.3f}  old {old_overall:.3f}  ({len(CASES)} cases)")
    assert overall >= 0.95
    assert {c: round(a, 3) for c, a in per_cat.items() if a < EXPECTED[c]} == {}
    assert old_overall < 0.8  # the gap this change closes: the old checker misses fractions, sets, percents, ...


def test_math_answer_scores_latex_answers_and_keeps_none_for_a_missing_reference():
    out = math_answer(
        ["q"] * 4,
        [r"so \boxed{\frac{2}{4}}", r"\boxed{[1,2]}", r"$\begin{pmatrix}1\\2\end{pmatrix}$", "x"],
        answer=[r"\frac12", "[1,2)", r"\begin{pmatrix}1\\2\end{pmatrix}", None],
    )
    assert out == [1.0, 0.0, 1.0, None]


# ---------------------------------------------------------------- the fast path: the smollm2-arith numbers


def _arith_completions(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(completion, reference) pairs as a small model answers 'Compute a + b': right, near misses, noise."""
    rng = random.Random(seed)
    forms = [
        "{x}", "{x}.", " {x}\n", "The answer is {x}.", "The answer is {x}", "Answer: {x}", "{x}.0", "-{x}", "{x:,}",
        "{s}", "{a} + {b} = {x}", "{a} + {b} = {x}. The answer is {x}.", "<answer>{x}</answer>", r"\boxed{{{x}}}",
        "I think it is {y}, no, {x}", "{x} apples", "{x}/1", "{x}e0", "The sum of {a} and {b} is {x}.", "{a}{b}",
        "It is {x}!", "{x} or {y}", "$ {x} $", "{x}, final", "the result: {x}", "{x}0", "0{x}",
        "Answer: {a} + {b} = {x}",
    ]  # fmt: skip
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        ref = a + b
        x = rng.choice([ref, ref, ref + rng.choice([-10, -1, 1, 10]), rng.randint(0, 1999), -ref, ref * 1000])
        s = " ".join(str(x))  # "5 7"
        pairs.append((rng.choice(forms).format(x=x, y=rng.randint(0, 198), a=a, b=b, s=s), str(ref)))
    return pairs


def test_fast_path_gives_the_old_verdict_on_arithmetic_completions_without_math_verify(monkeypatch):
    pairs = _arith_completions(4000)
    calls = []
    monkeypatch.setattr(fmath, "math_verify_match", lambda gold, pred: calls.append(pred) or False)
    fast = 0
    for completion, ref in pairs:
        before = len(calls)
        verdict = completion_matches(completion, ref)
        pred = extract_answer(completion)
        if pred is not None and is_plain_number(pred):
            fast += 1
            assert len(calls) == before, completion  # decided without math-verify
            assert verdict == answers_match(pred, ref), (completion, ref)
    # nothing reaches math-verify: "Answer: a + b = x" states x (the equation's last side). The old checker took the
    # whole equation as the answer (never a match); math-verify then read "The final answer is a + b = y" as a + b,
    # right for any y
    assert fast / len(pairs) > 0.95 and not calls


@pytest.mark.parametrize(
    "completion, ref, expected",
    [
        # worked out by hand from the fast path's rules: the last number, thousands commas dropped, 1e-6 relative
        ("The answer is 57.", "57", True),
        ("57", "57", True),
        ("57.0", "57", True),
        ("5 7", "57", False),  # the last number is 7
        ("-3", "3", False),
        ("-3", "-3", True),
        ("1,234", "1234", True),
        ("The answer is 1,234 apples.", "1234", True),
        ("I think 12, no, 13", "13", True),
        ("I think 13, no, 12", "13", False),
        ("<answer>8</answer> and then 9", "8", True),  # the tag wins over the last number
        (r"\boxed{100} is 10 squared", "100", True),
        ("3/4", "0.75", True),
        ("0.7500001", "0.75", True),  # within 1e-6 relative
        ("0.7501", "0.75", False),
        ("no idea", "5", False),  # no digit: no match, math-verify is not asked
        ("So $x = 57$.", "57", True),  # the math the last number sits in: x = 57 states 57
        ("So $x = 555 + 363$.", "918", False),  # the question restated, in math: unevaluated, math-verify is not asked
    ],
)
def test_fast_path_hand_computed(completion, ref, expected, monkeypatch):
    monkeypatch.setattr(fmath, "math_verify_match", lambda *a: pytest.fail("math-verify called on the fast path"))
    assert completion_matches(completion, ref) is expected
    assert math_answer(["q"], [completion], answer=[ref]) == [float(expected)]


# ---------------------------------------------------------------- bounded work, off the main thread


ADVERSARIAL = [r"$10^{10^{10}}$", r"\boxed{1000000!}", "2**2**2**2**2", "9**9**9**9", "$" + "+".join("x" * 2500) + "$"]


def test_adversarial_answers_finish_in_bounded_time_in_a_daemon_thread():
    out: list = []

    def work():  # the reward stage runs verifiers in a daemon thread (reward.score_timeout_s)
        n = len(ADVERSARIAL)  # a reference that is not a plain number, so math-verify parses them
        out.extend(math_answer(["q"] * n, ADVERSARIAL, answer=[r"\frac{1}{2}"] * n))

    t0 = time.perf_counter()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(120)
    # each is stopped by math-verify's own timeout in the child (2 s) or, at the latest, the 10 s hard bound
    assert not thread.is_alive() and out == [0.0] * len(ADVERSARIAL)
    assert time.perf_counter() - t0 < 5 * mathverify.ITEM_TIMEOUT_S
    assert math_answer(["q"], [r"\boxed{\frac{10}{4}}"], answer=["2.5"]) == [1.0]  # and it still works after


def test_a_check_past_the_hard_bound_kills_the_child_and_the_next_one_works(caplog):
    t0 = time.perf_counter()
    assert mathverify.math_verify_match("$5$", r"$10^{10^{10}}$", timeout_s=0.5) is False  # before the 2 s inner one
    assert time.perf_counter() - t0 < 5  # the log line below tells the kill from the inner timeout
    assert "stopped; scored 0.0" in caplog.text
    assert mathverify.math_verify_match(r"$\frac12$", r"\boxed{0.5}") is True


def test_missing_math_verify_is_one_clear_error_only_where_it_is_needed(tmp_path, monkeypatch):
    (tmp_path / "math_verify.py").write_text("raise ImportError('No module named math_verify')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the child sees this module first: as if it were not installed
    monkeypatch.setattr(mathverify, "_checker", mathverify._Checker())
    assert math_answer(["q"], ["The answer is 5."], answer=["5"]) == [1.0]  # plain numbers never need it
    with pytest.raises(mathverify.MathVerifyMissing, match=r"math_answer needs math-verify .*make setup") as e:
        math_answer(["q"], [r"\boxed{\frac12}"], answer=[r"\frac{1}{2}"])
    assert "\n" not in str(e.value)
