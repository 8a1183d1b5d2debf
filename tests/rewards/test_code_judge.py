"""code_exec's judge (forge/rewards/code_judge.py), no sandbox: which tests are rewritten how, the type-strict
comparison, the wire format's decoder on malformed input, and the result-line protocol."""

from __future__ import annotations

import math

import pytest

from forge.rewards import _sandbox_runner as runner
from forge.rewards.code_exec import read_results
from forge.rewards.code_judge import Check, canonical, checks_for, decode, rewrite, same


@pytest.mark.parametrize(
    "test,kind,expr,sent",
    [
        ("assert f(2) == 5", "value", "f(2)", {"expr": "f(2)"}),
        ("assert 5 == f(2)", "value", "f(2)", {"expr": "f(2)"}),  # the literal on the left
        ("assert f(2) == -5, 'a message'", "value", "f(2)", {"expr": "f(2)"}),
        ("assert g(*[1, 2]) == {'a': (1, None)}", "value", "g(*[1, 2])", {"expr": "g(*[1, 2])"}),
        ("assert f(x) is True", "value", "f(x)", {"expr": "f(x)"}),
        ("assert f(1) == f(0) + 1", "pair", "f(1)", {"expr": "f(1)", "expected": "f(0) + 1"}),
    ],
)
def test_rewritable_asserts_send_only_code(test, kind, expr, sent):
    check = rewrite(test)
    assert (check.kind, check.expr, check.request()) == (kind, expr, sent)  # the expected value is never sent


@pytest.mark.parametrize(
    "test",
    ["assert f(2)", "assert f(2) != 5", "assert 1 < f(2) < 3", "assert f(1) == 1 == g(1)", "assert f(2) is 5",
     "x = f(2)", "assert f(2) == 1j", "assert f(2) ==", "assert f(1) == 2; assert f(2) == 3"],
)  # fmt: skip
def test_free_form_tests_are_not_rewritten_and_need_trust(test):
    assert rewrite(test) is None
    assert checks_for((test,)) is None
    assert checks_for((test,), trusted=True) == (Check("statement", test),)


def test_comparison_is_pythons_on_builtin_values():
    equal = [(True, 1), (False, 0), (1, True), ({1: "x"}, {True: "x"}), (1, 1.0), (0.0, -0.0), ([1, (2, "a")], [1.0, (2, "a")]), ({1: "x"}, {1.0: "x"}),
             ({1, 2}, frozenset({2, 1})), ({"a": 1, "b": 2}, {"b": 2, "a": 1}), (None, None), (b"x", b"x"),
             (10**30, 10**30), (math.inf, math.inf)]  # fmt: skip
    different = [((1, 2), [1, 2]), ("1", 1), (b"a", "a"), (None, 0), (None, False), ({1}, [1]), ([math.nan], [math.nan]),
                 (10**30, float(10**30))]  # fmt: skip
    for a, b in equal:
        assert canonical(a) == canonical(b), (a, b)
    for a, b in different:
        assert canonical(a) != canonical(b), (a, b)
    with pytest.raises(TypeError):
        canonical(1j)


def test_the_runners_encoding_decodes_to_the_same_value():
    encode = runner.encoder()
    values = [None, True, 0, -(2**100), 2.5, -math.inf, "é\ud800😀\n\"", b"\x00", [1, [2, [3]]], (1, (2,)),
              {(1, "a"): {2}}, frozenset({"x"}), {"k": [None, (True,)]}, [], (), {}, set()]  # fmt: skip
    for value in values:
        assert decode(encode(value)) == canonical(value), value
    assert decode(encode(math.nan))[0] == "nan"
    for refused in (type("S", (str,), {})("s"), object(), 1j, [[[]]] * 1 + [object()], {1: object()}, range(3)):
        with pytest.raises(runner._NoValue):
            encode(refused)
    deep: list = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(runner._NoValue):
        encode(deep)


@pytest.mark.parametrize(
    "payload",
    ['{"x": [1]}', '{"t": 1}', '{"d": [[1]]}', '{"b": "zz"}', "[1,", "nan",
     "[" * 5000 + "]" * 5000, '{"t": [1], "s": [2]}', ""],
)  # fmt: skip
def test_malformed_payloads_fail_and_never_raise(payload):
    with pytest.raises(ValueError):
        decode(payload)
    assert not same(Check("value", "f()", want=canonical([1])), payload)


def test_result_lines_in_order_or_forged():
    checks = checks_for(("assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 6"))
    assert read_results(["loaded", "0 2", "1 4", "2 7", "done"], checks) == (2, "ok", "", "")
    assert read_results(["loaded", "0 2", "1 !", "2 6", "done"], checks) == (2, "ok", "", "")
    assert read_results(["loaded", "0 2", "1 4"], checks)[:2] == (2, "crashed")  # cut short: keeps what it had
    assert read_results(["load SystemExit: 0"], checks) == (0, "load_error", "SystemExit: 0", "")
    assert read_results([], checks)[:2] == (0, "crashed")
    forged = [
        ["loaded", "0 2", "0 2", "1 4", "2 6", "done"],  # a repeated index
        ["loaded", "0 2", "2 6", "1 4", "done"],  # out of order
        ["loaded", "0 2", "1 4", "2 6", "done", "done"],  # a line after the end
        ["loaded", "0 2", "1 4", "done"],  # done before every test
        ["loaded", "loaded", "0 2", "1 4", "2 6", "done"],
        ["load X", "loaded", "0 2", "1 4", "2 6", "done"],
        ["loaded", "0 2", "1 4", "2 6", "done", "output 41"],  # output nobody asked for
        ["loaded", "00 2", "1 4", "2 6", "done"],
    ]
    for lines in forged:
        assert read_results(lines, checks) == (0, "forged", "", ""), lines
    assert read_results(["loaded", "done", "output 6869"], (), want_output=True) == (0, "ok", "", "hi")


def test_a_forged_set_of_colliding_hashes_costs_no_quadratic_time():
    """Every multiple of 2**61 - 1 hashes to 0; sets and dicts are compared sorted, never hashed, so 20,000 of them
    (as a program writing on the result channel could send) decode at once."""
    import time

    ints = [i * (2**61 - 1) for i in range(20_000)]
    start = time.perf_counter()
    forged = decode('{"s": [%s]}' % ", ".join(map(str, reversed(ints))))  # noqa: UP031
    assert time.perf_counter() - start < 2.0  # a Python set of them takes seconds to build
    assert forged == ("set", tuple(("num", i) for i in ints))
