"""Helpers for driving the served dashboard: start `forgeweave` servers on 127.0.0.1 (stopped by PID), and open
pages in Debian's headless Chromium through playwright, waiting for known texts and drawn charts.

Used by tests/dashboard/test_browser.py and scripts/dashboard_screenshots.py. playwright is imported inside the
functions that need it; it drives /usr/bin/chromium (never a browser playwright downloads).
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `url` answers 200 (fails early if `proc` died)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    """Stop a server this test started (its own process group) by PID: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


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
    """`forgeweave dashboard` on a free port for the duration of the block; yields its URL."""
    port = free_port()
    proc = start_cli(["dashboard", "--runs-dir", str(runs_dir), "--port", str(port)], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", proc, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000):
    """A page of headless /usr/bin/chromium driven by playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
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
