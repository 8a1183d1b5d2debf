"""Helpers for driving the served dashboard: start `forgeweave` servers on 127.0.0.1 (stopped by PID), and open
pages in Debian's headless Chromium through playwright, waiting for known texts and drawn charts.

Used by tests/dashboard/test_browser.py and scripts/dashboard_screenshots.py. playwright is imported inside the
functions that need it; it drives /usr/bin/chromium (never a browser playwright downloads).
"""

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.servers import REPO, free_port, stop, wait_http

CHROMIUM = Path("/usr/bin/chromium")
# no sandbox (root in a container), and none of Chromium's background network traffic (there is no network)
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 90_000
CHART = "[data-testid='stVegaLiteChart'] svg.marks"
# the drawn data of a Vega chart (SVG renderer): the paths of its line / area / bar marks
MARKS = "(svg) => svg.querySelectorAll('g.role-mark path').length"


def start_cli(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`python -m flows.cli ARGS` in the background, in its own session (so `stop` reaches its children)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


@contextlib.contextmanager
def served_dashboard(runs_dir: Path, log: Path) -> Iterator[str]:
    """`forgeweave dashboard` on a free port for the duration of the block; yields the URL it printed, which holds
    the token that signs a browser in (`http://127.0.0.1:PORT/?token=...`)."""
    port = free_port()
    proc = start_cli(["dashboard", "--runs-dir", str(runs_dir), "--port", str(port)], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", timeout=120, proc=proc)
        yield re.search(r"dashboard on (http://\S+)", log.read_text()).group(1)
    finally:
        stop(proc)


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000, http_credentials: dict | None = None):
    """A page of headless /usr/bin/chromium driven by playwright; `http_credentials` ({"username", "password"})
    answer a server's HTTP basic-auth challenge as a person does in the browser's dialog."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": width, "height": height}, http_credentials=http_credentials)
        finally:
            browser.close()


def charts_drawn(page, at_least: int) -> None:
    """Wait until `at_least` Vega-Lite charts are on the page, and check each has drawn marks."""
    page.wait_for_function(f'document.querySelectorAll("{CHART}").length >= {at_least}', timeout=WAIT_MS)
    page.wait_for_timeout(1500)  # let Vega finish its render pass
    for chart in page.locator(CHART).all():
        assert chart.evaluate(MARKS) > 0
    # no script run in flight (live refresh re-runs every few seconds): the "Running..." badge is gone
    page.locator("[data-testid='stStatusWidget']").wait_for(state="hidden", timeout=WAIT_MS)


def table_cell(page, text: str) -> None:
    """Wait for a cell of an st.dataframe: the grid is drawn on a canvas, its hidden accessible copy has the text."""
    page.get_by_role("gridcell", name=text, exact=True, include_hidden=True).first.wait_for(
        state="attached", timeout=WAIT_MS
    )
