"""Regenerate docs/img/stack-*.png: the three browser tests against `forgeweave up` keep their screenshots.

Runs tests/browser/test_stack_ui.py (a stack on free ports, a run triggered in the Prefect UI, the dashboard,
MLflow's compare view of two runs) with FORGEWEAVE_SCREENSHOT_DIR pointing at docs/img (or --out).

    .venv/bin/python scripts/stack_screenshots.py            # ~4-5 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "docs" / "img"), help="where the screenshots go (default docs/img)")
    args = p.parse_args()
    env = {**os.environ, "FORGEWEAVE_SCREENSHOT_DIR": str(Path(args.out).resolve()), "PYTHONPATH": str(REPO)}
    test = REPO / "tests" / "browser" / "test_stack_ui.py"
    return subprocess.run([sys.executable, "-m", "pytest", str(test), "-q", "-x"], cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
