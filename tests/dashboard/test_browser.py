"""The dashboard as a user sees it: `forgeweave dashboard` serves it on 127.0.0.1 and Debian's headless Chromium,
driven by playwright, opens the Runs and Run detail pages of a real tiny run and checks the run's name and its
charts are drawn, then its Samples tab's token view (issue 44): an episode's tokens drawn as spans, those the policy
sampled apart from those a tool added, each with its log-prob on hover. Screenshots go to the test's tmp dir; set
FORGEWEAVE_SCREENSHOT_DIR (e.g. docs/img) to keep them.
"""

import os
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.dashboard.browser import CHROMIUM, WAIT_MS, charts_drawn, chromium_page, served_dashboard, table_cell
from tests.dashboard.conftest import RUN
from tests.episode_samples import write_tool_episodes


def _keep(shot: Path) -> None:
    if os.environ.get("FORGEWEAVE_SCREENSHOT_DIR"):
        out = Path(os.environ["FORGEWEAVE_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / shot.name)


def test_runs_and_run_detail_in_chromium(tiny_run, tmp_path):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make setup` installs it (apt-get install chromium)")
    log = tmp_path / "dashboard.log"
    # a copy of the run whose samples gain two tool-calling episodes (a step 13; tests.episode_samples): the token
    # view then has tokens of both kinds, with no second run and no second server
    runs = tmp_path / "runs"
    shutil.copytree(tiny_run, runs / RUN)
    write_tool_episodes(runs / RUN, step=13, version=12, trainer_version=12)
    with served_dashboard(runs, log) as url, chromium_page() as page:
        base, token = url.split("/?token=")
        page.goto(base)  # without the token: the login prompt, no run data
        page.get_by_role("button", name="Log in").wait_for(timeout=WAIT_MS)
        assert RUN not in page.content()
        page.goto(url)
        page.get_by_text("1 run — 0 running, 1 finished, 0 failed").wait_for(timeout=WAIT_MS)
        table_cell(page, RUN)
        table_cell(page, "12/12")
        page.get_by_text("eval/pass@1", exact=True).first.wait_for(timeout=WAIT_MS)  # a chart's title
        charts_drawn(page, 2)
        page.screenshot(path=tmp_path / "dashboard-runs.png")

        # selecting the run's row (its checkbox, left of the first data row) opens it on the Run detail page
        table = page.locator("[data-testid='stDataFrame']").first.bounding_box()
        page.mouse.click(table["x"] + 15, table["y"] + 52)
        page.wait_for_url(f"**/run?run={RUN}", timeout=WAIT_MS)
        page.set_viewport_size({"width": 1400, "height": 2800})  # Streamlit scrolls inside the page: a tall window
        page.get_by_text(str((runs / RUN).resolve()), exact=True).wait_for(timeout=WAIT_MS)  # the run's directory
        # the header's "steps" metric. Seen 2 times in 12 runs on a loaded machine (2026-12-05): after the click the
        # page showed the run's directory but never its metrics (the runs page's 5 s live refresh racing the page
        # switch, by the look of it); one reload then shows them. Not yet understood: said in the notes.
        steps = page.get_by_test_id("stMetricValue").filter(has_text="12/12").first
        try:
            steps.wait_for(timeout=30_000)
        except PlaywrightTimeout:
            page.goto(f"{base}/run?run={RUN}&token={token}")  # a reload is a new session: signed in again
            steps.wait_for(timeout=WAIT_MS)
        page.get_by_text("reward (mean ± std, per verifier)").wait_for(timeout=WAIT_MS)
        charts_drawn(page, 10)
        page.screenshot(path=tmp_path / "dashboard-run-detail.png")
        token_view(page, tmp_path / "dashboard-tokens.png")
    assert "Traceback" not in log.read_text(), log.read_text()
    for name in ("dashboard-runs.png", "dashboard-run-detail.png", "dashboard-tokens.png"):
        assert (tmp_path / name).stat().st_size > 20_000
        _keep(tmp_path / name)


def token_view(page, shot: Path) -> None:
    """The Samples tab: the picked episode (the first tool-calling one) drawn as token spans, the policy's on blue
    and the tools' answers on grey, each sampled one with its log-prob as its hover text."""
    page.get_by_role("tab", name="Samples").click()
    legend = page.get_by_text("added by the environment, tools or agent (loss mask 0, not trained)")
    legend.wait_for(timeout=WAIT_MS)
    view = page.locator(".fw-tokens").first
    view.wait_for(timeout=WAIT_MS)
    view.scroll_into_view_if_needed()
    sampled, added = view.locator(".fw-sampled"), view.locator(".fw-added")
    assert (sampled.count(), added.count()) == (141, 111)  # tests.episode_samples: three turns, two tool answers
    assert sampled.first.get_attribute("title").endswith("log-prob -0.5 (p 0.6065)")
    assert added.first.inner_text() == "<" and added.first.get_attribute("title").endswith("not trained")
    colour = "(el) => getComputedStyle(el).backgroundColor"
    assert (
        sampled.first.evaluate(colour) == "rgb(207, 227, 255)" and added.first.evaluate(colour) == "rgb(230, 230, 230)"
    )
    above, box = legend.bounding_box(), view.bounding_box()  # the legend, then the tokens
    page.screenshot(path=shot, clip={"x": box["x"], "y": above["y"] - 8, "width": box["width"],
                                     "height": box["y"] + box["height"] - above["y"] + 16})  # fmt: skip
