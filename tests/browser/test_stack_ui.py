"""The three ways people use forgeweave, in headless Chromium (playwright driving /usr/bin/chromium) against one
`forgeweave up` stack on non-default ports (started once for the module, stopped by PID in teardown). The stack asks
who you are: the tests take the credentials from the file `up` names, log in to the Prefect UI on its login page
with the auth string, and answer MLflow's HTTP basic-auth challenge with the user and password, as a person does:

1. the Prefect UI: the `pipeline` deployment → Run → Custom run, preset `tiny` and short overrides, Submit; the
   flow run's page shows it Completed, and the run directory it made is a valid, finished run;
2. the Streamlit dashboard, opened with the token of the URL `up` prints, shows that run with its curves;
3. the MLflow UI: two finished runs of the forgeweave experiment (the UI's and one `forgeweave run` made against
   the stack) selected, Compare: the metric chart and the parameters that differ.

Screenshots go to the test's tmp dir; with FORGEWEAVE_SCREENSHOT_DIR (scripts/stack_screenshots.py sets docs/img)
they are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from flows.stack_auth import read_credentials
from tests.dashboard.browser import CHROMIUM, WAIT_MS, charts_drawn, chromium_page
from tests.stack_helpers import cli, running_stack

UI_RUN = "from-prefect-ui"
CLI_RUN = "from-cli-lr3e-4"
OVERRIDES = ["steps=3", "eval.k=0", "eval.every=3", "threads=1"]
RUN_TIMEOUT_MS = 400_000  # a 3-step tiny flow run: ~25 s alone, minutes on 2 cores shared with other jobs


def _keep(shot: Path) -> None:
    assert shot.stat().st_size > 20_000, f"{shot} looks blank"
    if os.environ.get("FORGEWEAVE_SCREENSHOT_DIR"):
        out = Path(os.environ["FORGEWEAVE_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / shot.name)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make setup` installs it (apt-get install chromium)")
    runs = tmp_path_factory.mktemp("stack-ui") / "runs"
    with running_stack(runs) as state:
        yield runs, state


def _prefect_login(page, state: dict) -> None:
    """Open the Prefect UI: it shows its login page; enter the auth string from the credentials file, as a person
    does; then the deployments page, opened afresh so the notices of the calls refused before the login go.

    The UI keeps the accepted auth string in the browser's localStorage (`prefect-password`); the login page's URL
    (`/login?redirect=/deployments`) already ends in /deployments, so waiting for the URL proves nothing: wait for
    the stored credential instead (a CI run that reloaded before the UI had stored it saw the login page again)."""
    creds = read_credentials(Path(state["credentials"]).parent.parent)
    deployments = state["services"]["prefect"]["url"] + "/deployments"
    page.goto(deployments)
    page.wait_for_url("**/login**", timeout=WAIT_MS)  # without the auth string the UI shows nothing else
    page.get_by_placeholder("admin:pass").fill(creds.prefect_auth_string)
    page.get_by_role("button", name="Login").click()
    page.wait_for_function("() => localStorage.getItem('prefect-password') !== null", timeout=WAIT_MS)
    page.goto(deployments)
    page.wait_for_url(deployments, timeout=WAIT_MS)


def _field(page, label: str):
    """The input area of a parameter in Prefect's run form (its <label for> names no id of the textarea)."""
    return page.locator(".p-label", has=page.get_by_text(label, exact=True))


@pytest.fixture(scope="module")
def ui_run(stack, tmp_path_factory):
    """Trigger the pipeline from the Prefect UI as a person does; returns (flow run id, run dir, screenshot)."""
    runs, state = stack
    shot = tmp_path_factory.mktemp("shots") / "stack-prefect-run.png"
    with chromium_page(1400, 1100) as page:
        _prefect_login(page, state)
        page.get_by_text("pipeline", exact=True).first.click(timeout=WAIT_MS)
        page.wait_for_url("**/deployments/deployment/**", timeout=WAIT_MS)
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        page.get_by_role("button", name="list", exact=True).click()  # `overrides` is list | None: a list
        for i, item in enumerate(OVERRIDES):
            page.get_by_role("button", name="Add item").click()
            _field(page, "overrides (Optional)").locator("textarea").nth(i).fill(item)
        _field(page, "name (Optional)").locator("textarea").fill(UI_RUN)
        preset = _field(page, "preset (Optional)").locator("textarea")
        assert preset.input_value() == ""  # empty = the config file's `preset:`, else tiny (flows/pipeline.py)
        preset.fill("tiny")
        flow_run_name = page.locator("input").first.input_value()  # the run name the form proposes
        page.get_by_role("button", name="Submit").click()
        page.get_by_role("link", name=flow_run_name, exact=True).first.click(timeout=WAIT_MS)
        page.wait_for_url("**/runs/flow-run/**", timeout=WAIT_MS)
        flow_run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", page.url).group(1)
        page.get_by_text(re.compile(r"^(Completed|Failed|Crashed)$")).first.wait_for(timeout=RUN_TIMEOUT_MS)
        final = page.get_by_text(re.compile(r"^(Completed|Failed|Crashed)$")).first.inner_text()
        page.get_by_text(flow_run_name).first.wait_for(timeout=WAIT_MS)
        page.wait_for_timeout(1500)
        page.screenshot(path=shot)
    return {"id": flow_run_id, "state": final, "dir": runs / UI_RUN, "shot": shot, "name": flow_run_name}


def test_prefect_ui_custom_run_completes(ui_run, stack):
    runs, state = stack
    log = Path(state["services"]["serve"]["log"]).read_text()[-3000:]
    assert ui_run["state"] == "Completed", log
    summary = json.loads((ui_run["dir"] / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["prefect_flow_run_id"] == ui_run["id"]
    assert summary["preset"] == "tiny"
    assert json.loads((ui_run["dir"] / "status.json").read_text())["state"] == "finished"
    assert (ui_run["dir"] / "checkpoints" / "step-000003" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (ui_run["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"] for m in metrics if "reward/mean" in m} == {1, 2, 3}
    # the flow run tracked into the stack's MLflow server (serve's environment), not an embedded store
    assert summary["mlflow_run_id"]
    _keep(ui_run["shot"])


def test_dashboard_shows_the_ui_run(ui_run, stack, tmp_path):
    runs, state = stack
    signed = re.search(r"^dashboard: (http://\S+)$", state["up_stdout"], re.M).group(1)
    assert signed.startswith(state["services"]["dashboard"]["url"] + "/?token=")
    with chromium_page(1400, 2400) as page:
        page.goto(signed.replace("/?", f"/run?run={UI_RUN}&"))
        page.get_by_text(str(ui_run["dir"].resolve()), exact=True).wait_for(timeout=WAIT_MS)  # the run's directory
        page.get_by_text("3/3", exact=True).wait_for(timeout=WAIT_MS)  # steps done / planned
        page.get_by_text("reward (mean ± std, per verifier)").wait_for(timeout=WAIT_MS)
        charts_drawn(page, 4)
        page.screenshot(path=tmp_path / "stack-dashboard-run.png")
    _keep(tmp_path / "stack-dashboard-run.png")


@pytest.fixture(scope="module")
def cli_run(stack):
    """A second run, by `forgeweave run` on the same runs dir: it finds the stack and tracks into its servers."""
    runs, _ = stack
    sets = [a for s in [*OVERRIDES, "update.lr=3e-4"] for a in ("--set", s)]
    proc = cli(["run", "--preset", "tiny", *sets, "--name", CLI_RUN, "--runs-dir", str(runs), "--quiet"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_mlflow_compare_two_runs(ui_run, cli_run, stack, tmp_path):
    runs, state = stack
    assert f"MLFLOW_TRACKING_URI={state['env']['MLFLOW_TRACKING_URI']}" in cli_run  # it used the stack
    assert json.loads((runs / CLI_RUN / "summary.json").read_text())["mlflow_run_id"]
    creds = read_credentials(runs / ".stack")
    login = {"username": creds.mlflow_username, "password": creds.mlflow_password}  # MLflow's basic-auth challenge
    with chromium_page(1400, 1750, http_credentials=login) as page:  # tall: the chart, run details, parameters
        page.goto(state["services"]["mlflow"]["url"] + "/#/experiments/1/runs?workflowType=machine_learning")
        for name in (UI_RUN, CLI_RUN):
            row = page.locator("[role=row]", has=page.get_by_role("link", name=name, exact=True))
            row.get_by_label("Press Space to toggle row selection").check(timeout=WAIT_MS)
        page.get_by_role("button", name="Compare").click()
        page.get_by_text("Comparing 2 Runs from 1 Experiment").wait_for(timeout=WAIT_MS)
        # the metric chart: a drawn plotly figure with the differing parameter and the eval metric as axes
        plot = page.locator(".js-plotly-plot").first
        plot.locator("text", has_text="update.lr").first.wait_for(timeout=WAIT_MS)
        plot.locator("text", has_text="eval/pass_at_1").first.wait_for(timeout=WAIT_MS)
        assert plot.locator("path").count() > 0
        # the parameter diff: only update.lr differs (1e-3 for the tiny preset, 3e-4 for the CLI run)
        page.get_by_role("switch", name="Parameters - Show diff only").click()
        params = page.locator("tr", has=page.get_by_text("update.lr", exact=True)).last
        text = params.inner_text()
        assert "0.001" in text and "0.0003" in text, text
        assert page.get_by_text("rollout.group_size", exact=True).count() == 0  # equal params are hidden
        assistant = page.get_by_role("button", name="Close")  # MLflow's assistant side panel, when it is open
        if assistant.count():
            assistant.first.click()
        page.screenshot(path=tmp_path / "stack-mlflow-compare.png")
    _keep(tmp_path / "stack-mlflow-compare.png")
