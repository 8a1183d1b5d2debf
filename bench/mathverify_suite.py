r"""Math-Verify's own (gold, prediction, expected) test cases: extract them to a fixture; measure math_answer on them.

Math-Verify (https://github.com/huggingface/Math-Verify, Apache-2.0) keeps its regression cases as literal tuples in
`@pytest.mark.parametrize` decorators under tests/. `extract` reads those files from a git clone (bare or not: files
are read with `git show COMMIT:PATH`) into tests/fixtures/mathverify_suite.jsonl, parses them with `ast` (nothing is
imported or run) and writes one JSON line per case: the case's file, test, gold, prediction and expected verdict,
how that test calls math-verify (extraction targets, float rounding, strict, allow_set_relation_comp), and whether
tests/test_math_verify_suite.py runs it, or why not. The first line names the source, commit and licence.

A case is excluded when its verdict rests on a `verify` setting `math_answer` cannot express (see `exclusion`).
Tests that are not case tables (mocked timeouts, raise_on_error, sympy-level precision asserts, parse-only
StringExtractionConfig and NormalizationConfig checks) hold no (gold, prediction, verdict) triple and are skipped.
None of the cases needs the network.

`measure` scores the included cases three ways and lists where math_answer differs: math_answer
(`completion_matches(pred, gold)`: the prediction is the completion, the gold the answer column, as is); math-verify
as math_answer calls it (`math_verify_match`: default extraction targets, the gold wrapped in `$...$` unless it
has delimiters); and math-verify as each of their tests calls it (its targets, LatexExtractionConfig with
boxed_match_priority=0, its float rounding), the suite's own verdicts.

Usage: python bench/mathverify_suite.py extract GIT_DIR [--commit HEAD] [--out tests/fixtures/mathverify_suite.jsonl]
       python bench/mathverify_suite.py measure [--fixture tests/fixtures/mathverify_suite.jsonl]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

SOURCE = "https://github.com/huggingface/Math-Verify"
LICENSE = (
    "Apache-2.0 (the repository's LICENCE); tests/test_all.py also carries an MIT notice: "
    "Copyright (c) 2024 The HuggingFace Team. See tests/fixtures/mathverify_suite.NOTICE.md"
)
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mathverify_suite.jsonl"
# compare_strings(gold, pred, match_types=["latex", "expr"], precision=6, strict=True, allow_set_relation_comp=False)
# in their tests/test_all.py: its defaults, which every test that passes no keyword gets
HARNESS_DEFAULTS = {"targets": ["latex", "expr"], "precision": 6, "strict": True, "allow_set_relation_comp": False}
# a test that calls verify(parse(gold), parse(pred)) directly: math-verify's own defaults
API_DEFAULTS = {"targets": ["default"], "precision": 6, "strict": True, "allow_set_relation_comp": False}
# compare_strings' keyword -> our name for it
_KEYWORDS = {
    "match_types": "targets",
    "precision": "precision",
    "strict": "strict",
    "allow_set_relation_comp": "allow_set_relation_comp",
}
_PRECISION_TOLERATED = {5, 6}  # float_rounding 5 or 6: math_answer's 1e-6 relative tolerance gives these verdicts


@dataclass(frozen=True)
class Case:
    """One parametrized case of a Math-Verify test."""

    file: str  # path in their repository
    test: str  # test function
    gold: str
    pred: str
    expected: bool
    call: dict  # how the test calls math-verify: targets, precision, strict, allow_set_relation_comp
    excluded_because: str | None  # None = the suite test runs it


def exclusion(call: dict) -> str | None:
    """Why a case with this call is not run, or None when math_answer's behaviour should give its verdict.

    >>> exclusion(HARNESS_DEFAULTS) is None, exclusion({**HARNESS_DEFAULTS, "strict": False})
    (True, 'strict=False (variables compared loosely): math_answer is always strict')
    """
    if not call["strict"]:
        return "strict=False (variables compared loosely): math_answer is always strict"
    if call["allow_set_relation_comp"]:
        return "allow_set_relation_comp=True (a set compared with an inequality): math_answer leaves it off"
    if call["precision"] not in _PRECISION_TOLERATED:
        return f"float_rounding={call['precision']}: math_answer compares numbers to 1e-6 relative, not settable"
    return None


def literal(node: ast.AST) -> object:
    """A literal's value; also an f-string of literals and `math.<fn>(literal)` (one case spells sqrt(17) so).

    >>> literal(ast.parse('f"{math.sqrt(4):.1f}"', mode="eval").body), literal(ast.parse("[1, 'a']").body[0].value)
    ('2.0', [1, 'a'])
    """
    if isinstance(node, ast.List):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(literal(e) for e in node.elts)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(literal(v)) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        spec = literal(node.format_spec) if node.format_spec else ""
        return format(literal(node.value), spec)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        if node.func.value.id == "math" and not node.keywords:
            return getattr(math, node.func.attr)(*[literal(a) for a in node.args])
    return ast.literal_eval(node)


def _parametrize(fn: ast.FunctionDef) -> tuple[list[str], ast.AST] | None:
    """A parametrized test's argument names and its (unevaluated) table of cases."""
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.parametrize":
            return [n.strip() for n in literal(dec.args[0]).split(",")], dec.args[1]
    return None


def _call_shape(fn: ast.FunctionDef) -> dict[str, object] | None:
    """The test's call to compare_strings (keyword -> literal value or parameter name), or API_DEFAULTS."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "compare_strings":
            shape: dict[str, object] = dict(HARNESS_DEFAULTS)
            for kw in node.keywords:
                key = _KEYWORDS[kw.arg]
                shape[key] = ("param", kw.value.id) if isinstance(kw.value, ast.Name) else literal(kw.value)
            return shape
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "verify" and "parse(" in ast.unparse(node):
            return dict(API_DEFAULTS)
    return None


def cases_in(path: str, source: str) -> list[Case]:
    """Every parametrized (gold, pred, expected) case of the tests in one file."""
    out = []
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef) or (table := _parametrize(fn)) is None:
            continue
        names, rows = table
        shape = _call_shape(fn)
        if shape is None or "gold" not in names:
            continue  # parse-only tests (StringExtractionConfig): no gold, no verdict
        for row in literal(rows):
            args = dict(zip(names, row, strict=True))
            call = {k: args[v[1]] if isinstance(v, tuple) else v for k, v in shape.items()}
            expected = bool(args["expected"] if "expected" in args else args["result"])
            out.append(Case(path, fn.name, args["gold"], args["pred"], expected, call, exclusion(call)))
    return out


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def extract(git_dir: str, commit: str, out: Path) -> None:
    commit = _git(git_dir, "rev-parse", commit).strip()
    version = next(
        line.split('"')[1] for line in _git(git_dir, "show", f"{commit}:pyproject.toml").splitlines()
        if line.startswith("version")
    )  # fmt: skip
    listing = _git(git_dir, "ls-tree", "-r", "--name-only", commit, "tests/").split()
    paths = sorted(p for p in listing if p.endswith(".py"))
    cases = [c for p in paths for c in cases_in(p, _git(git_dir, "show", f"{commit}:{p}"))]
    header = {"source": SOURCE, "commit": commit, "version": version, "paths": "tests/*.py", "license": LICENSE,
              "extracted_by": "bench/mathverify_suite.py", "cases": len(cases)}  # fmt: skip
    with out.open("w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        for c in cases:
            f.write(json.dumps(asdict(c), ensure_ascii=False) + "\n")
    excluded = Counter(c.excluded_because for c in cases if c.excluded_because)
    print(f"{len(cases)} cases from {len(paths)} files at {commit[:7]} (version {version}) -> {out}")
    print(f"  included {len(cases) - sum(excluded.values())}; excluded: {dict(excluded)}")


def load(path: Path = OUT) -> tuple[dict, list[dict]]:
    """The fixture's header and its cases (dicts with Case's fields)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["header"], lines[1:]


def _as_their_test_calls(case: dict) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    call = case["call"]
    if call["targets"] == ["default"]:
        return bool(verify(parse(case["gold"]), parse(case["pred"])))
    make = {"latex": lambda: LatexExtractionConfig(boxed_match_priority=0), "expr": ExprExtractionConfig}
    targets = [make[t]() for t in call["targets"]]
    gold, pred = parse(case["gold"], targets), parse(case["pred"], targets)
    options = {k: call[k] for k in ("strict", "allow_set_relation_comp")}
    return bool(verify(gold, pred, float_rounding=call["precision"], **options))


def measure(path: Path) -> None:
    from forge.rewards.math import _gold_text, completion_matches
    from forge.rewards.mathverify import math_verify_match

    header, cases = load(path)
    included = [c for c in cases if not c["excluded_because"]]
    checks = {
        "math_answer": lambda c: completion_matches(c["pred"], c["gold"]),
        "math-verify as math_answer calls it": lambda c: math_verify_match(_gold_text(c["gold"]), c["pred"]),
        "math-verify as their test calls it": _as_their_test_calls,
    }
    print(f"Math-Verify {header['version']} @ {header['commit'][:7]}: {len(included)} cases run, "
          f"{len(cases) - len(included)} excluded")  # fmt: skip
    for name, check in checks.items():
        t0 = time.perf_counter()
        wrong = [c for c in included if check(c) != c["expected"]]
        right, seconds = len(included) - len(wrong), time.perf_counter() - t0
        print(f"{name:38s} {right}/{len(included)} = {right / len(included):.3f}  ({seconds:.1f} s)")
        for c in wrong if name == "math_answer" else []:
            print(f"  differs: {c['test']} gold {c['gold'][-60:]!r} pred {c['pred'][-80:]!r} expected {c['expected']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="write the fixture from a clone of huggingface/Math-Verify")
    ex.add_argument("git_dir", help="a (bare) clone of huggingface/Math-Verify")
    ex.add_argument("--commit", default="HEAD")
    ex.add_argument("--out", type=Path, default=OUT)
    me = sub.add_parser("measure", help="agreement of math_answer and of math-verify with the expected verdicts")
    me.add_argument("--fixture", type=Path, default=OUT)
    args = ap.parse_args()
    if args.cmd == "extract":
        extract(args.git_dir, args.commit, args.out)
    else:
        measure(args.fixture)


if __name__ == "__main__":
    main()
