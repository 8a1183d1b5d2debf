"""The dashboard only reads: it never imports the training code (forge, flows, torch), and imports mlflow and
prefect lazily, only where a page asks a store or a server."""

import ast
import subprocess
import sys
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboard"
CHECK = """
import sys
import dashboard.data, dashboard.loaders, dashboard.charts, dashboard.mlflow_store, dashboard.actions, dashboard.widgets
bad = sorted({m.split(".")[0] for m in sys.modules} & {"forge", "flows", "weaver", "torch", "mlflow", "prefect"})
print("imported:", ",".join(bad) or "none")
"""


def test_dashboard_modules_import_no_training_code():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "imported: none"


def test_no_dashboard_file_imports_forge_or_flows():
    for path in sorted(DASHBOARD.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("forge", "flows", "weaver", "torch") for n in names), (path, names)
