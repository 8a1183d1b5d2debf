"""Reward stage: answer extraction and matching, built-in verifiers, the registry, weighted scoring."""

from __future__ import annotations

import math

import pytest
import torch

from forge.errors import UserError
from forge.rewards.math import answers_match, extract_answer
from forge.rewards.registry import resolve_verifier, resolve_verifiers
from forge.rewards.score import per_verifier_means, score_completions
from forge.rewards.verifiers import BUILTIN, format_integer, format_tags, math_answer

# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"First \boxed{1}, finally \boxed{\frac{a^{2}}{b+1}}.", r"\frac{a^{2}}{b+1}"),  # last one, nested braces
        (r"\boxed{7} then cut off \boxed{\frac{1}{2}", "7"),  # an unclosed box is skipped
        ("think... <answer> 12 </answer> and 99 after", "12"),  # tags beat the last number
        ("The answer is 42.", "42"),
        ("so, Answer: -3", "-3"),
        ("The final answer is $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("The answer is 42 apples because 6*7", "42"),
        ("3 + 4 = 7, then 7 - 2 = 5", "5"),  # last number
        ("we get 5-3 = 2 and the temperature is -4", "-4"),  # negatives
        ("5-3", "3"),  # a minus after a digit is subtraction, not a sign
        ("A total of 1,234 apples", "1234"),  # thousands separator dropped
        ("1,2,3", "3"),  # a list, not thousands
        ("the ratio is 3/4.", "3/4"),
        ("pi is about 3.14159!", "3.14159"),
        ("$-0.5$", "-0.5"),
        ("I do not know", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("42", "42"),
        ("42.0", "42"),
        ("1,234", "1234"),
        ("0.75", "3/4"),
        ("1e-6", "0.000001"),
        ("1.0000001", "1"),  # within 1e-6 relative
        ("-7", "-7"),
        (r"\frac{3}{4}", "0.75"),
        (r"\dfrac{1}{2}", "1/2"),
        ("2*(x+1)", "2*x+2"),
        ("x^2-1", "(x-1)(x+1)"),
        (r"2\sqrt{2}", "sqrt(8)"),
        ("x = 5", "5"),
        ("$5$", "5"),
        ("Paris", "paris"),
    ],
)
def test_answers_match_hits(pred, ref):
    assert answers_match(pred, ref)


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("-5", "5"),  # sign matters
        ("42", "43"),
        ("1.00001", "1"),  # 1e-5 relative is outside tolerance
        ("2*x+1", "2*x+2"),
        (None, "5"),
        ("9**9**9", "1"),  # stacked powers never reach sympy (they would not finish)
        ("__import__('os').getcwd()", "0"),  # parse_expr evals; unsafe text never reaches it
        ("London", "Paris"),
    ],
)
def test_answers_match_misses(pred, ref):
    assert not answers_match(pred, ref)


# ---------------------------------------------------------------- built-in verifiers


def test_math_answer_hit_miss_and_missing_reference():
    out = math_answer(
        ["q"] * 4, [r"so \boxed{12}", "It is 13.", "The answer is 1,000", "12"], answer=[12, "12", "1000", None]
    )
    assert out == [1.0, 0.0, 1.0, None]


def test_math_answer_ignores_extra_columns():
    assert math_answer(["q"], ["4"], answer=["4"], difficulty=["easy"]) == [1.0]


def test_format_integer():
    texts = [
        "42",
        " -7\n",
        "+3",
        "The sum is 12.",
        "12.5",
        "12 or 13",
        "twelve",
        "so the sum of these two numbers is 12",
    ]
    assert format_integer(["q"] * len(texts), texts, answer=[None] * len(texts)) == [
        1.0, 1.0, 1.0,  # bare integers
        0.5, 0.5,  # one number, few words
        0.0, 0.0, 0.0,  # two numbers; none; too many words
    ]  # fmt: skip


def test_format_tags():
    texts = [
        "x <answer>7</answer>",
        "<answer>\n7\n</answer>",
        "<answer>7</answer><answer>8</answer>",
        "<answer></answer>",
        "7",
        "<answer>7",
    ]
    assert format_tags(["q"] * len(texts), texts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_builtins_listed():
    assert set(BUILTIN) == {"math_answer", "format_integer", "format_tags"}


# ---------------------------------------------------------------- registry

USER_MODULE = """
def exact(prompts, completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]

def trl_style(completions, **kwargs):
    return [float(len(c)) for c in completions]

def no_kwargs(prompts, completions):
    return [0.0 for _ in completions]

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_resolve_builtin():
    assert resolve_verifier("math_answer") == ("math_answer", math_answer)


def test_resolve_import_path(user_module):
    name, fn = resolve_verifier(f"{user_module}:exact")
    assert name == "exact"
    assert fn(["q", "q"], ["a", "b"], answer=["a", "a"]) == [1.0, 0.0]
    # TRL reward functions often take only `completions` (+ **kwargs): verifiers are called by keyword
    trl = resolve_verifier(f"{user_module}:trl_style")
    assert trl[0] == "trl_style"
    assert score_completions([trl], None, ["q"], ["abc"], {}).rewards.tolist() == [3.0]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("math_answr", "did you mean 'math_answer'?"),
        ("zzz", "built-ins: math_answer, format_integer, format_tags"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("broken_rewards:fn", "RuntimeError: boom second line"),
        ("my_rewards:missing", "has no attribute 'missing'"),
        ("my_rewards:NOT_A_FUNCTION", "is a int, not a function"),
        ("my_rewards:no_kwargs", "must accept (prompts, completions, **kwargs)"),
        ("my_rewards:", "must look like 'pkg.module:function'"),
    ],
)
def test_resolve_errors_are_one_line(user_module, spec, needle):
    with pytest.raises(UserError) as info:
        resolve_verifier(spec)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_resolve_verifiers_rejects_duplicates():
    with pytest.raises(UserError, match="names 'format_tags' twice"):
        resolve_verifiers(["format_tags", "math_answer", "format_tags"])


# ---------------------------------------------------------------- scoring


def _fragile(prompts, completions, **kwargs):
    """Raises on any batch holding 'boom' (so the batch call fails and items are retried one by one)."""
    if "boom" in completions:
        raise ValueError("cannot score boom")
    return [1.0 for _ in completions]


def _length_or_none(prompts, completions, **kwargs):
    return [None if c == "skip" else float(len(c)) for c in completions]


def test_score_completions_isolates_failures():
    completions = ["ab", "boom", "skip", "abcd"]
    result = score_completions(
        [("fragile", _fragile), ("length", _length_or_none)], [2.0, 0.5], ["q"] * 4, completions, {"answer": ["x"] * 4}
    )
    assert result.names == ["fragile", "length"]
    assert result.scores.shape == (4, 2) and result.scores.dtype == torch.float32
    assert torch.isnan(result.scores[1, 0]) and torch.isnan(result.scores[2, 1])
    assert result.failures == {"fragile": 1, "length": 1}
    assert result.errors == {"fragile": "ValueError('cannot score boom')"}  # None is not an error
    # by hand, NaN counted as 0:  ab: 2*1 + 0.5*2 = 3;  boom: 2*0 + 0.5*4 = 2;  skip: 2*1 + 0 = 2;  abcd: 2 + 0.5*4 = 4
    assert result.rewards.tolist() == [3.0, 2.0, 2.0, 4.0]
    # means over scored items only: fragile 3/3 = 1.0; length (2 + 4 + 4) / 3
    means = per_verifier_means(result.names, result.scores)
    assert means["fragile"] == 1.0 and means["length"] == pytest.approx(10 / 3)


def test_score_completions_weights_default_to_one():
    result = score_completions(
        [("math_answer", math_answer), ("format_integer", format_integer)],
        None,
        ["1+1", "1+1"],
        ["2", "It is 3"],
        {"answer": ["2", "2"]},
    )
    # "2": 1 + 1 = 2;  "It is 3": 0 + 0.5 = 0.5
    assert result.rewards.tolist() == [2.0, 0.5]
    assert result.failures == {"math_answer": 0, "format_integer": 0} and result.errors == {}


def test_score_completions_wrong_length_and_bad_values_are_failures():
    def short(prompts, completions, **kwargs):
        return [1.0]

    def odd(prompts, completions, **kwargs):
        return [float("inf"), "yes", 0.25]

    result = score_completions([("short", short), ("odd", odd)], [1.0, 4.0], ["q"] * 3, ["a", "b", "c"], {})
    assert result.failures == {"short": 3, "odd": 2}
    assert result.errors["short"] == "returned 1 scores for 3 completions"
    assert "non-finite" in result.errors["odd"]
    assert result.rewards.tolist() == [0.0, 0.0, 1.0]  # 4 * 0.25 on the last item only
    assert math.isnan(per_verifier_means(result.names, result.scores)["short"])


def test_score_completions_bad_weights_length():
    with pytest.raises(UserError, match="reward.weights has 1 values for 2 verifiers"):
        score_completions([("a", _fragile), ("b", _fragile)], [1.0], ["q"], ["x"], {})
