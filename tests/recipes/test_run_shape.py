"""The loop's shape (issue 43), read from the source: the run's context is one `Run`, what changes one `LoopState`.

- No function in forge/recipes, forge/loop.py or forge/stages.py takes more than 4 positional parameters (`self` and
  `cls` not counted; keyword-only ones are named at every call).
- None both returns a value and mutates one of its arguments: assigns to an attribute or item of a parameter, or
  calls a mutating method on one (`append`, `update`, `pop`, ...). A method may change its own object (`self`) only
  if it returns nothing.
- `LoopState` and `Run` are frozen, and the loop's old holders are gone (the sampler cursor, the `ahead` dict).

Run it alone: `python -m pytest tests/recipes/test_run_shape.py -q`; the same walk lists offenders by name.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([*(ROOT / "forge" / "recipes").glob("*.py"), ROOT / "forge" / "loop.py", ROOT / "forge" / "stages.py"])
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "sort", "reverse", "__setitem__", "__delitem__"}  # fmt: skip


def functions():
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node


def positional(fn: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def root_name(node: ast.AST) -> str | None:
    """The variable an attribute/subscript chain starts from: `a.b[c].d` -> "a"."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def mutated(fn: ast.FunctionDef) -> set[str]:
    """Parameters the function changes in place (assignments through them, mutating method calls on them)."""
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    hit = set()
    for node in ast.walk(fn):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for part in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(part, (ast.Attribute, ast.Subscript)) and root_name(part) in params:
                    hit.add(root_name(part))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if isinstance(node.func.value, (ast.Name, ast.Attribute, ast.Subscript)):
                name = root_name(node.func.value)
                hit |= {name} & params
    return hit


def returns_value(fn: ast.FunctionDef) -> bool:
    own = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    nested = {id(r) for f in ast.walk(fn) if f is not fn and isinstance(f, (ast.FunctionDef, ast.Lambda))
              for r in ast.walk(f) if isinstance(r, ast.Return)}  # fmt: skip
    return any(id(r) not in nested and not (isinstance(r.value, ast.Constant) and r.value.value is None) for r in own)


def test_no_function_takes_more_than_four_positional_parameters():
    wide = {where: positional(fn) for where, fn in functions() if len(positional(fn)) > 4}
    assert not wide, f"more than 4 positional parameters (make the rest keyword-only or pass the Run): {wide}"


def test_no_function_both_returns_a_value_and_mutates_an_argument():
    both = {where: sorted(mutated(fn)) for where, fn in functions() if returns_value(fn) and mutated(fn)}
    assert not both, f"returns a value and mutates an argument: {both}"


def test_the_walk_catches_what_it_claims_to():
    src = """
def ok(run, state, step):
    return replace(state, step=step)
def bad(state, ahead, step):
    ahead[step] = 1
    return state
def bad2(record, x):
    record.seen.add(x)
    return x
def fine(self, x):
    self.count = x
"""
    fns = {f.name: f for f in ast.parse(src).body}
    assert [(n, returns_value(f), sorted(mutated(f))) for n, f in fns.items()] == [
        ("ok", True, []), ("bad", True, ["ahead"]), ("bad2", True, ["record"]), ("fine", False, ["self"])]
    assert positional(ast.parse("def f(self, a, b, c, d, *, e): pass").body[0]) == ["a", "b", "c", "d"]


def test_the_loop_state_and_the_run_are_frozen_and_hold_what_changes():
    from forge.loop import LoopState, Run

    assert dataclasses.fields(Run) and Run.__dataclass_params__.frozen and LoopState.__dataclass_params__.frozen
    fields = {f.name for f in dataclasses.fields(LoopState)}
    assert {"guard", "ahead", "restarts", "row_offset", "shown_errors"} <= fields
    import forge.data

    assert not hasattr(forge.data, "PromptSampler")  # prompts are derived from (seed, step), no cursor is carried
