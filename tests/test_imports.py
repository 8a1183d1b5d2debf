"""forge must import where only torch / transformers / accelerate / safetensors / numpy exist (e.g. a GPU box, or
.venv-vllm for an engine actor): importing it must not pull in the orchestration (Prefect, Ray), tracking or UI
packages, nor the packages above it.

Three checks: the source of every forge module names none of them in any import, however deep in a function
(a lazy import is still a dependency); every forge module imports with them made unimportable; and the modules
the Ray actors load leave none of them (nor the heavy data packages) in sys.modules."""

import ast
import subprocess
import sys
from pathlib import Path

FORGE = Path(__file__).resolve().parents[1] / "forge"
FORBIDDEN = ("mlflow", "prefect", "streamlit", "ray", "flows", "dashboard", "weaver", "wandb", "tensorboard")
FORBIDDEN_MODULES = ("torch.utils.tensorboard",)  # imports the tensorboard package


def forbidden(module: str) -> bool:
    return module.split(".")[0] in FORBIDDEN or module.startswith(FORBIDDEN_MODULES)


def imported_names(tree: ast.AST):
    """(line, module name) of every import in a module: statements at any depth, and the string argument of
    `importlib.import_module("...")` / `import_module("...")` / `__import__("...")`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and _callee(node.func) in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def _callee(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def forbidden_imports(path: Path, source: str) -> dict[str, str]:
    """{"file:line": the forbidden module imported there}."""
    found: dict[str, str] = {}
    for line, module in imported_names(ast.parse(source, filename=str(path))):
        if forbidden(module):
            found.setdefault(f"{path}:{line}", module)  # `from a import b` yields a, then a.b: the first names it
    return found


def test_no_forge_module_imports_orchestration_tracking_or_ui_packages_even_lazily():
    found: dict[str, str] = {}
    for path in sorted(FORGE.rglob("*.py")):
        found |= forbidden_imports(path.relative_to(FORGE.parent), path.read_text(encoding="utf-8"))
    lines = [f"{where}: {module}" for where, module in sorted(found.items())]
    assert not lines, "forge imports what it must not (move that code to flows/):\n" + "\n".join(lines)


def test_the_import_check_sees_lazy_and_dynamic_imports():
    source = """
def f():
    import mlflow.tracking
    from prefect import flow
    from torch.utils.tensorboard import SummaryWriter
    importlib.import_module("flows.cli")
    __import__("ray")
    from forge import config
    from . import sibling
"""
    assert forbidden_imports(Path("x.py"), source) == {
        "x.py:3": "mlflow.tracking", "x.py:4": "prefect", "x.py:5": "torch.utils.tensorboard", "x.py:6": "flows.cli",
        "x.py:7": "ray",
    }  # fmt: skip


BLOCKED = """
import importlib, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` raises ImportError; importlib.util.find_spec(name) says not installed
import forge

names = [m.name for m in pkgutil.walk_packages(forge.__path__, "forge.")]
for name in names:
    importlib.import_module(name)
print("imported", len(names))
"""


def test_every_forge_module_imports_with_those_packages_unimportable():
    code = BLOCKED.format(blocked=set(FORBIDDEN))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("imported ") and int(out.stdout.split()[1]) > 30


CHECK = """
import sys
import forge.recipes.grpo, forge.rewards.ensemble, forge.rewards.aggregate, forge.rewards.judges, forge.trainer
import forge.workers, forge.stages, forge.compose, forge.rollout.vllm  # the Ray actors' workers: vllm is imported only by an engine
import forge.tracking  # the Tracker protocol and metrics.jsonl; MLflow, TensorBoard and W&B live in flows.tracking
import forge.api  # forge.train: datasets is imported only when a dataset object is given
bad = sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "mlflow", "streamlit", "pyarrow", "flows",
                                                       "weaver", "dashboard", "pandas", "ray", "vllm",
                                                       "tensorboard", "wandb", "datasets", "math_verify"})
print("imported:", ",".join(bad) or "none")
"""


def test_forge_imports_without_orchestration_packages():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "imported: none"
