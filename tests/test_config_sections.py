"""Each component takes its own config section (issue 43): only the config composite and the API know `RunConfig`.

The composite is forge/config.py (RunConfig and its cross-section rules), forge/config_compat.py (old keys),
forge/presets.py (named configs) and forge/compose.py (the run config taken apart: each component built from the
sections it reads); the API is forge/api.py, forge/recipes/grpo.py and forge/recipes/wiring.py (what the recipe
builds from the config before its loop starts: the run's record, the prep stage, the loop's context). Any other module under forge/ that names
`RunConfig` in code fails: an `import`/`from ... import RunConfig` at any depth (a `TYPE_CHECKING` import too), an
annotation or a string annotation naming it, `forge.config.RunConfig` as an attribute. Docstrings and comments do
not count. A module holding a transitional shim that forwards the run config to `forge.compose` carries the marker
`LEGACY(issue 43)` and counts as knowing it too.

`PENDING` lists the modules that still know it, each with why; the test fails when the list is wrong either way, so
a module that stops knowing `RunConfig` must leave the list. Count them with
`python tests/test_config_sections.py` (prints every forge module that knows RunConfig, allowed ones marked).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORGE = ROOT / "forge"
COMPOSITE = {"forge/config.py", "forge/config_compat.py", "forge/presets.py", "forge/compose.py"}
API = {"forge/api.py", "forge/recipes/grpo.py", "forge/recipes/wiring.py"}
MARKER = "LEGACY(issue 43)"
PENDING: dict[str, str] = {}
MAX_CONFIG_LINES = 300


def _annotations(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            yield from (arg.annotation for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                        if arg is not None and arg.annotation is not None)  # fmt: skip
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def names_run_config(source: str) -> list[int]:
    """Lines where `source` names RunConfig in code (imports, names, attributes, string annotations)."""
    tree, lines = ast.parse(source), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom | ast.Import) and any(
            a.name.split(".")[-1] == "RunConfig" for a in node.names
        ):
            lines.add(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "RunConfig":
            lines.add(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "RunConfig":
            lines.add(node.lineno)
    for ann in _annotations(tree):
        for node in ast.walk(ann):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "RunConfig" in node.value:
                lines.add(node.lineno)
    return sorted(lines)


def knowing_modules() -> dict[str, str]:
    """forge module (repo-relative path) -> why it counts as knowing RunConfig."""
    found = {}
    for path in sorted(FORGE.rglob("*.py")):
        source, rel = path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
        if lines := names_run_config(source):
            found[rel] = f"names RunConfig on lines {lines}"
        elif MARKER in source:
            found[rel] = f"holds a {MARKER} shim"
    return found


def test_only_the_composite_and_the_api_know_run_config():
    found = {m: why for m, why in knowing_modules().items() if m not in COMPOSITE | API}
    unexpected = {m: why for m, why in found.items() if m not in PENDING}
    assert not unexpected, "these modules know RunConfig: pass them their own sections instead:\n" + "\n".join(
        f"  {m}: {why}" for m, why in unexpected.items()
    )
    done = sorted(set(PENDING) - set(found))
    assert not done, f"{done} no longer know RunConfig: remove them from PENDING in {Path(__file__).name}"


def test_config_py_only_composes_sections():
    lines = len((FORGE / "config.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_CONFIG_LINES, f"forge/config.py has {lines} lines (> {MAX_CONFIG_LINES}): move a section out"


def test_the_check_sees_every_way_of_naming_it():
    source = '''
"""RunConfig in a docstring does not count."""
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from forge.config import RunConfig
import forge.config
def f(cfg: "RunConfig") -> None:
    x = forge.config.RunConfig()
def g(cfg: "dict[str, RunConfig]"): ...
# RunConfig in a comment does not count
'''
    assert names_run_config(source) == [5, 7, 8, 9]
    assert names_run_config('"""RunConfig"""\ndef f(cfg: dict) -> None: ...\n') == []


if __name__ == "__main__":
    known = knowing_modules()
    for module, why in known.items():
        tag = (
            "composite" if module in COMPOSITE else "api" if module in API else "PENDING" if module in PENDING else "X"
        )
        print(f"{tag:9} {module}: {why}")
    others = [m for m in known if m not in COMPOSITE | API]
    print(f"{len(others)} module(s) outside the composite and the API know RunConfig")
