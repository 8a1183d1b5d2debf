'''The code task: complete a one-line Python function from its docstring; scored by running hidden tests.

Each prompt is the start of a function whose docstring says what it returns; the completion continues after
`return` (HumanEval style), and the answer column holds the hidden tests as JSON with the code the completion
continues (`{"prefix": <the prompt>, "tests": ["assert f(0) == 2", ...]}`). For example (prompt, then a right
completion):

    def f(n):
        """Return n times 7, plus 2."""
        return| n * 7 + 2

Generators: `generate_function_tasks` (12 kinds of function: arithmetic, order of operands, digits, min/max,
remainders; 5 variable names, random constants: 600 distinct problems, a seeded 100 of them held out; the
`smollm2-code` preset). The tiny random model cannot write any of that from scratch (a right 3-character body is a
one-in-a-million draw for it), so `tiny-code` gets a fill-in-the-middle version, `generate_operator_tasks`:
`n times 7: def f(n): return n` + completion + suffix `7`, where the completion is the operator (135 problems,
27 held out).

Checks: none of its own. The reward and the evaluation are the `code_exec` verifier (forge/rewards/code_exec.py),
which runs prefix + completion (+ suffix) against the tests in its sandbox: the share of tests passed is the
reward, and a completion is correct for pass@1 / pass@k when every test passes.

`python -m forge.tasks.code` rewrites the shipped files (forge/tasks/code_{fn,op}_{train,eval}.jsonl); a test
checks they match these generators.
'''

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from forge.io import atomic_write_bytes
from forge.tasks import TASKS_DIR, to_jsonl

TRAIN_FILE, EVAL_FILE = TASKS_DIR / "code_fn_train.jsonl", TASKS_DIR / "code_fn_eval.jsonl"
VARIABLES = ("x", "n", "k", "m", "y")
TEST_INPUTS = (0, 1, 3, 8, 25)
TOTAL, EVAL_SIZE = 600, 100

# kind -> (docstring with {v} {a} {b}, reference body, the function as Python)
KINDS: dict[str, tuple[str, str, Callable[[int, int, int], int]]] = {
    "affine": ("{v} times {a}, plus {b}", "{v} * {a} + {b}", lambda v, a, b: v * a + b),
    "affine_inner": ("{v} plus {b}, times {a}", "({v} + {b}) * {a}", lambda v, a, b: (v + b) * a),
    "reverse_sub": ("{a} minus {v}", "{a} - {v}", lambda v, a, b: a - v),
    "square_minus": ("the square of {v}, minus {a}", "{v} ** 2 - {a}", lambda v, a, b: v * v - a),
    "floordiv": ("{v} divided by {a}, rounded down", "{v} // {a}", lambda v, a, b: v // a),
    "remainder": ("the remainder of {v} divided by {a}", "{v} % {a}", lambda v, a, b: v % a),
    "last_digit": ("the last digit of {v}", "{v} % 10", lambda v, a, b: v % 10),
    "larger": ("the larger of {v} and {a}", "max({v}, {a})", lambda v, a, b: max(v, a)),
    "smaller": ("the smaller of {v} and {a}", "min({v}, {a})", lambda v, a, b: min(v, a)),
    "distance": ("the distance between {v} and {a}", "abs({v} - {a})", lambda v, a, b: abs(v - a)),
    "double_minus": ("twice {v}, minus {a}", "2 * {v} - {a}", lambda v, a, b: 2 * v - a),
    "is_multiple": ("True if {v} is a multiple of {a}, else False", "{v} % {a} == 0", lambda v, a, b: v % a == 0),
}


def function_task(kind: str, var: str, a: int, b: int) -> dict:
    '''One problem: prompt (the code to continue), the reference body (`solution`, never shown) and hidden tests.

    >>> row = function_task("affine", "n", 7, 2)
    >>> print(row["prompt"])
    def f(n):
        """Return n times 7, plus 2."""
        return
    >>> row["solution"], json.loads(row["answer"])["tests"][2]
    (' n * 7 + 2', 'assert f(3) == 23')
    '''
    doc, body, fn = KINDS[kind]
    prompt = f'def f({var}):\n    """Return {doc.format(v=var, a=a, b=b)}."""\n    return'
    tests = [f"assert f({x}) == {fn(x, a, b)!r}" for x in TEST_INPUTS]
    return {
        "id": f"fn-{kind}-{var}-{a}-{b}",
        "kind": kind,
        "prompt": prompt,
        "answer": json.dumps({"prefix": prompt, "tests": tests}),
        "solution": " " + body.format(v=var, a=a, b=b),
    }


def generate_function_tasks(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows): TOTAL distinct problems drawn with this seed, EVAL_SIZE of them held out."""
    rng = np.random.default_rng(seed)
    kinds, found = list(KINDS), {}
    while len(found) < TOTAL:
        kind, var = kinds[rng.integers(len(kinds))], VARIABLES[rng.integers(len(VARIABLES))]
        a, b = int(rng.integers(2, 10)), int(rng.integers(1, 10))
        b = b if "{b}" in KINDS[kind][0] else 0  # a kind without b has one problem per (var, a)
        found.setdefault((kind, var, a, b), None)
    rows = [function_task(*key) for key in found]
    return rows[EVAL_SIZE:], rows[:EVAL_SIZE]


OP_TRAIN_FILE, OP_EVAL_FILE = TASKS_DIR / "code_op_train.jsonl", TASKS_DIR / "code_op_eval.jsonl"
OPERATORS = {"plus": "+", "minus": "-", "times": "*"}


def operator_task(var: str, word: str, const: int) -> dict:
    """The tiny model's version: the completion is the one character between `return n` and the constant.

    >>> row = operator_task("n", "times", 7)
    >>> row["prompt"], json.loads(row["answer"])["suffix"], row["solution"]
    ('n times 7: def f(n): return n', '7', '*')
    """
    fn = {"plus": lambda v: v + const, "minus": lambda v: v - const, "times": lambda v: v * const}[word]
    prefix = f"def f({var}): return {var}"
    tests = [f"assert f({x}) == {fn(x)}" for x in TEST_INPUTS]
    return {
        "id": f"op-{var}-{word}-{const}",
        "prompt": f"{var} {word} {const}: {prefix}",
        "answer": json.dumps({"prefix": prefix, "suffix": str(const), "tests": tests}),
        "solution": OPERATORS[word],
    }


def generate_operator_tasks(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval): 5 variables x 3 operators x constants 1-9 = 135 problems, a seeded 27 held out."""
    rows = [operator_task(v, w, c) for v in VARIABLES for w in OPERATORS for c in range(1, 10)]
    order = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in order[27:]], [rows[i] for i in order[:27]]


def write_task_files() -> None:
    """Rewrite the four shipped files from the generators (seed 0)."""
    train, evaluation = generate_function_tasks()
    atomic_write_bytes(TRAIN_FILE, to_jsonl(train))
    atomic_write_bytes(EVAL_FILE, to_jsonl(evaluation))
    train, evaluation = generate_operator_tasks()
    atomic_write_bytes(OP_TRAIN_FILE, to_jsonl(train))
    atomic_write_bytes(OP_EVAL_FILE, to_jsonl(evaluation))


if __name__ == "__main__":
    write_task_files()
