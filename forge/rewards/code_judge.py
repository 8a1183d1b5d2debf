r"""How `code_exec` judges a test: outside the program's interpreter, on values it could not fake.

The program under test and the code that runs it share one interpreter in the sandbox, so anything that runs
there can be rewritten by the program: an `__eq__` that always says yes, a patched `builtins.compile`, a result
line written by hand. So the sandbox only *evaluates*; the verdict is reached here, in forge's process:

- `checks_for` rewrites each test into a `Check`. `assert <expr> == <literal>` (either side the literal; also
  `assert <expr> is None/True/False`) becomes a value check: only `<expr>` goes to the sandbox, and the expected
  value is parsed here with `ast.literal_eval` and never sent, so the program cannot read it to echo it back.
  `assert <a> == <b>` with neither side a literal is a pair check: both sides are evaluated in the sandbox (the
  program can see and influence them: weaker, see docs/code-exec.md). Any other test (`assert is_sorted(f(x))`,
  `assert f(x)`, a statement) is free-form: it can only be judged inside the program's interpreter, where it can
  be forged, so it is allowed only in a suite marked `"trusted": true` and is then run as a statement (passes when
  it raises nothing). An untrusted suite with one is not a test spec (`checks_for` gives None).
- The sandbox sends each value back as JSON built from exact built-in types only (`_sandbox_runner.py`); a value
  of any other type (a subclass of int, a class with its own `__eq__`) is no value, and its test fails.
- `decode` and `same` compare here, as Python's `==` compares these exact built-in types: None, numbers (bool,
  int and float by value: True == 1 == 1.0), str, bytes, list, tuple, dict and set (set and frozenset alike) each
  equal only their own kind, so [1] is not (1,) and "1" is not 1; NaN equals nothing, itself included; containers
  compare element by element under the same rules (dicts as sets of key/value pairs, in any order). An honest
  program therefore scores what Python's own `assert` gave it; only values of other types (where `==` is the
  program's own code) are refused.

`suspicious` is a cheap flag for completions that reach for the tools of a forgery (`__eq__` overrides,
`builtins`, frame introspection, `sys.exit`...). It judges nothing, only counts (`reward/code_exec/suspicious`):
a forgery scores 0 whether or not it is flagged.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

_MAX_DEPTH = 100  # nesting of a value; the sandbox refuses deeper ones too
_NAN_IDS = itertools.count()
_SUSPICIOUS = re.compile(
    r"__(?:eq|ne|bool|hash)__|\b__builtins__\b|\bbuiltins\b|_getframe|\binspect\b|\bgc\b|\bf_(?:back|locals|globals)\b"
    r"|\bsys\s*\.\s*(?:exit|modules)\b|\bos\s*\.\s*(?:_exit|kill|write|dup2?)\b|\bSystemExit\b|\b(?:exit|quit)\s*\("
    r"|\bctypes\b|/proc/self"
)


@dataclass(frozen=True)
class Check:
    """One test as the judge sees it. `value`: `expr`'s value must equal `want` (canonical, see `canonical`);
    `pair`: `expr`'s value must equal `expected`'s, both evaluated in the sandbox; `statement`: `expr` is run as a
    statement and passes when it raises nothing (trusted suites only)."""

    kind: Literal["value", "pair", "statement"]
    expr: str
    expected: str = ""  # pair: the expected side's expression
    want: tuple = ()  # value: canonical expected value (never leaves this process)

    def request(self) -> dict[str, str]:
        """What the sandbox gets for this check: the code to evaluate, never the expected value."""
        if self.kind == "statement":
            return {"stmt": self.expr}
        return {"expr": self.expr, "expected": self.expected} if self.kind == "pair" else {"expr": self.expr}


@functools.lru_cache(maxsize=4096)
def checks_for(tests: tuple[str, ...], trusted: bool = False) -> tuple[Check, ...] | None:
    """The checks for a suite's tests, or None when one is free-form (not `assert <expr> == <expr>`, or comparing
    with a literal the judge does not compare, such as a complex number) in a suite not marked trusted.

    >>> [c.kind for c in checks_for(("assert f(2) == 5", "assert 'a' == g()", "assert f(1) == g(1)"))]
    ['value', 'value', 'pair']
    >>> checks_for(("assert f(2) == 5", "assert is_sorted(f([2, 1]))")) is None
    True
    >>> checks_for(("assert is_sorted(f([2, 1]))",), trusted=True)[0].kind
    'statement'
    """
    checks = [rewrite(t) for t in tests]
    if not trusted and any(c is None for c in checks):
        return None
    return tuple(c or Check("statement", t) for c, t in zip(checks, tests, strict=True))


def rewrite(test: str) -> Check | None:
    """A value or pair check for `assert a == b` / `assert a is None|True|False` (a message is ignored), else None.

    >>> rewrite("assert f(2) == [1, (2, 3)]")
    Check(kind='value', expr='f(2)', expected='', want=('list', (('num', 1), ('tuple', (('num', 2), ('num', 3))))))
    >>> rewrite("assert f(x) is None").want, rewrite("assert f(x) != 5"), rewrite("assert f(x) == 1j")
    (('none',), None, None)
    """
    try:
        body = ast.parse(test, mode="exec").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assert) or not isinstance(body[0].test, ast.Compare):
        return None
    compare = body[0].test
    if len(compare.ops) != 1:
        return None
    left, op, right = compare.left, compare.ops[0], compare.comparators[0]
    if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and type(right.value) in (bool, type(None)):
        return Check("value", ast.unparse(left), want=canonical(right.value))
    if not isinstance(op, ast.Eq):
        return None
    for expr, literal in ((left, right), (right, left)):
        try:
            value = ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        return _value_check(expr, value)
    return Check("pair", ast.unparse(left), expected=ast.unparse(right))


def _value_check(expr: ast.expr, value: Any) -> Check | None:
    """A value check; None (free-form) for a literal the judge does not compare (complex, Ellipsis)."""
    try:
        return Check("value", ast.unparse(expr), want=canonical(value))
    except (TypeError, ValueError):
        return None


def canonical(value: Any, depth: int = 0) -> tuple:
    """A value as a tree of tuples that compares as Python's `==` does on these types (see the module docstring): (kind, value) with one
    kind for int and float ("num"), sets and dicts as sorted tuples of elements / (key, value) pairs. Two trees of
    one kind always order, so sorting works where hashing would not be safe: a forged set of ints whose hashes all
    collide would cost forge quadratic time. TypeError for a type the judge does not compare, ValueError past the
    nesting limit.

    >>> nan = float("nan")
    >>> canonical(True) == canonical(1), canonical(1) == canonical(1.0), canonical(nan) == canonical(nan)
    (True, True, False)
    """
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deep")
    kind = type(value)
    if value is None:
        return ("none",)
    if kind is bool:
        return ("num", int(value))  # True == 1, as in Python: an honest `n > 7` where 0/1 is expected passes
    if kind is float and value != value:
        return ("nan", next(_NAN_IDS))  # a fresh number: NaN equals nothing
    if kind is int or kind is float:
        return ("num", value)
    if kind is str or kind is bytes:
        return (kind.__name__, value)
    return _canonical_container(value, kind, depth + 1)


def _canonical_container(value: Any, kind: type, depth: int) -> tuple:
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(canonical(x, depth) for x in value))
    if kind is set or kind is frozenset:
        return ("set", tuple(sorted(canonical(x, depth) for x in value)))
    if kind is dict:
        return ("dict", tuple(sorted((canonical(k, depth), canonical(v, depth)) for k, v in value.items())))
    raise TypeError(f"a {kind.__name__} is not a value the judge compares")


def decode(payload: str) -> tuple:
    """The canonical value of a JSON payload the sandbox sent (`_sandbox_runner.encode`); ValueError if malformed.

    >>> decode('[1, {"t": [true, "a"]}, {"d": [[2, null]]}]') == canonical([1, (True, "a"), {2: None}])
    True
    >>> decode('{"s": [1.5, NaN]}')[0], decode('{"b": "6869"}')
    ('set', ('bytes', b'hi'))
    """
    try:
        return _from_wire(json.loads(payload), 0)
    except (TypeError, RecursionError, MemoryError) as e:
        raise ValueError(f"bad value: {type(e).__name__}") from None


def _from_wire(node: Any, depth: int) -> tuple:
    """The canonical value of a decoded JSON node: an array is a list, {"t"|"s"|"d"|"b": ...} a tuple, set, dict
    (as [key, value] pairs) or bytes (hex)."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deep")
    if type(node) is list:
        return ("list", tuple(_from_wire(x, depth + 1) for x in node))
    if type(node) is not dict:
        return canonical(node)  # None, bool, int, float or str: json.loads makes nothing else
    if len(node) != 1 or next(iter(node)) not in ("t", "s", "d", "b"):
        raise ValueError("unknown object on the wire")
    tag, items = next(iter(node.items()))
    if tag == "b":
        return ("bytes", bytes.fromhex(items))
    if type(items) is not list:
        raise ValueError("a container's items must be a JSON array")
    if tag == "d":
        return ("dict", tuple(sorted(_wire_entry(x, depth + 1) for x in items)))
    values = (_from_wire(x, depth + 1) for x in items)
    return ("tuple", tuple(values)) if tag == "t" else ("set", tuple(sorted(values)))


def _wire_entry(item: Any, depth: int) -> tuple[tuple, tuple]:
    if type(item) is not list or len(item) != 2:
        raise ValueError("a dict entry must be [key, value]")
    return _from_wire(item[0], depth), _from_wire(item[1], depth)


def same(check: Check, payload: str) -> bool:
    """Whether the sandbox's payload for `check` passes it: for a value check the expression's value equals `want`,
    for a pair check the JSON array of both sides' values has two equal ones; a statement check needs `true`.
    "!" (the sandbox had no value: it raised, or was of a type the wire does not carry) and anything malformed fail.

    >>> same(Check("value", "f(2)", want=canonical(5)), "5"), same(Check("value", "f(2)", want=canonical(5)), "true")
    (True, False)
    >>> same(Check("pair", "f(1)", "g(1)"), '[[1, 2], [1, 2.0]]'), same(Check("pair", "f(1)", "g(1)"), '[NaN, NaN]')
    (True, False)
    """
    if payload == "!":
        return False
    if check.kind == "statement":
        return payload == "true"
    try:
        if check.kind == "value":
            return decode(payload) == check.want
        both = json.loads(payload)
        if type(both) is not list or len(both) != 2:
            return False
        return _from_wire(both[0], 0) == _from_wire(both[1], 0)
    except (ValueError, TypeError, RecursionError, MemoryError):
        return False


def suspicious(completion: str) -> bool:
    r"""Whether a completion names one of the tools of a forgery: an `__eq__`/`__ne__`/`__bool__`/`__hash__`
    override, `builtins`, introspection (`sys._getframe`, `inspect`, `gc`, `f_back`, `f_locals`, `f_globals`,
    `sys.modules`), an early exit (`sys.exit`, `os._exit`, `os.kill`, `SystemExit`, `exit()`), raw fd writes
    (`os.write`, `os.dup`, `os.dup2`, `/proc/self`) or `ctypes`. A cheap text match (comments and strings count
    too), for the `reward/code_exec/suspicious` metric only.

    >>> suspicious("def f(x):\n    return x + 3"), suspicious("class A:\n    def __eq__(self, o): return True")
    (False, True)
    >>> suspicious("import sys\nsys . exit(0)"), suspicious("def f(x): return os._exit(0)")
    (True, True)
    """
    return _SUSPICIOUS.search(completion) is not None


def count_suspicious(completions: list[str]) -> int:
    """How many completions `suspicious` flags."""
    return sum(suspicious(c) for c in completions)
