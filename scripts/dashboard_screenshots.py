"""Regenerate the dashboard screenshots in docs/img from real runs.

Trains two tiny-preset runs (the default learning rate and a lower one, 200 steps each, plain recipe) into
--runs-dir (a temporary directory by default; runs that finished there already are kept), serves that directory
with `forgeweave dashboard` on 127.0.0.1, and shoots the Runs, Run detail and Compare pages in headless
/usr/bin/chromium with the same helpers as the browser test.

    .venv/bin/python scripts/dashboard_screenshots.py            # ~4 min on 2 busy cores, writes docs/img
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.dashboard.browser import WAIT_MS, charts_drawn, chromium_page, served_dashboard, table_cell  # noqa: E402

RUNS = {"tiny-lr1e-3": [], "tiny-lr3e-4": ["update.lr=3e-4"]}  # run name -> --set overrides of the tiny preset


def train(runs_dir: Path) -> None:
    for name, overrides in RUNS.items():
        if (runs_dir / name / "summary.json").exists():
            continue
        sets = [a for s in ["eval.every=25", "checkpoint.every=50", *overrides] for a in ("--set", s)]
        cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--name", name, *sets]
        print("training", name, flush=True)
        subprocess.run([*cmd, "--runs-dir", str(runs_dir), "--no-prefect", "--quiet"], cwd=REPO, check=True)


def shoot(runs_dir: Path, out: Path) -> None:
    first, second = RUNS
    with served_dashboard(runs_dir, out / "dashboard.log") as signed, chromium_page(1400, 1000) as page:
        url, token = signed.split("/?token=")  # each goto is a new session: each signs in with the token
        page.goto(signed)
        table_cell(page, first)
        charts_drawn(page, 2)
        page.screenshot(path=out / "dashboard-runs.png")
        page.set_viewport_size({"width": 1400, "height": 2800})
        page.goto(f"{url}/run?run={first}&token={token}")
        page.get_by_text("reward (mean ± std, per verifier)").wait_for(timeout=WAIT_MS)
        charts_drawn(page, 10)
        page.screenshot(path=out / "dashboard-run-detail.png")
        page.set_viewport_size({"width": 1400, "height": 1300})
        page.goto(f"{url}/compare?token={token}")
        page.get_by_text("Config differences").wait_for(timeout=WAIT_MS)
        charts_drawn(page, 1)
        page.screenshot(path=out / "dashboard-compare.png")
    (out / "dashboard.log").unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-dir", help="where to train (or find) the two tiny runs; default: a temporary directory")
    p.add_argument("--out", default=str(REPO / "docs" / "img"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="forgeweave-shots-") as tmp:
        runs_dir = Path(args.runs_dir) if args.runs_dir else Path(tmp) / "runs"
        train(runs_dir)
        shoot(runs_dir, out)
    print(f"screenshots in {out}")


if __name__ == "__main__":
    main()
