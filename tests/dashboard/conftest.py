"""Fixtures for the dashboard tests: one real tiny run per session (through the CLI), copies of it altered into a
half-written run or a second run to compare, and AppTest helpers that read back what a page shows."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from streamlit.testing.v1 import AppTest

from flows.stack_auth import login_digest

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "dashboard" / "app.py"
RUN = "dash-demo"
# 12 steps with an eval and a checkpoint every 4: four eval points (0, 4, 8, 12) and three checkpoints
TINY_RUN = ["steps=12", "eval.every=4", "checkpoint.every=4", "threads=1"]


MT_RUN = "mt-demo"
# the tiny-multiturn preset, 2 steps on a few rows, without MLflow: a real multi-turn run's files (its random model
# makes no tool calls; tests.episode_samples adds episodes that do)
MT_SETS = ["steps=2", "threads=1", "data.train_size=100", "eval.max_problems=5", "tracking.mlflow=false"]


def cli_run(runs: Path, preset: str, name: str, sets: list[str]) -> Path:
    """`forgeweave run --no-prefect` of `preset` with `--set`s into runs/name; returns the run directory."""
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", preset, *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--name", name, "--runs-dir", str(runs), "--no-prefect", "--quiet"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return runs / name


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished tiny run made by `forgeweave run --no-prefect` (about 15 s); returns its run directory."""
    return cli_run(tmp_path_factory.mktemp("dash") / "runs", "tiny", RUN, TINY_RUN)


@pytest.fixture(scope="session")
def multiturn_run(tmp_path_factory) -> Path:
    """A finished tiny-multiturn run (about 10 s); returns its run directory."""
    return cli_run(tmp_path_factory.mktemp("dash-mt") / "runs", "tiny-multiturn", MT_RUN, MT_SETS)


@pytest.fixture
def runs_copy(tiny_run, tmp_path) -> Path:
    """A private runs dir holding a copy of the tiny run (tests may add or alter runs in it)."""
    runs = tmp_path / "runs"
    shutil.copytree(tiny_run, runs / RUN)
    return runs


def make_half_written(run: Path, step: int) -> None:
    """Turn a finished run into one caught mid-training at `step`: status running, no summary, metrics and samples
    up to `step` then a torn line, no checkpoint after `step`."""
    (run / "summary.json").unlink()
    (run / "status.json").write_text(json.dumps({"state": "running", "step": step, "updated": 1.0e9}))
    for name in ("metrics.jsonl", "samples.jsonl"):
        lines = [ln for ln in (run / name).read_text().splitlines() if json.loads(ln)["step"] <= step]
        (run / name).write_text("\n".join(lines) + '\n{"step": ' + str(step + 1) + ', "reward/me')
    for ckpt in (run / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    (run / "checkpoints" / "latest").write_text(f"step-{step - step % 4:06d}\n")


def make_variant(runs: Path, name: str, lr: float) -> Path:
    """A second run: a copy of the tiny run with another update.lr in its config and rewards shifted by +0.5."""
    run = runs / name
    shutil.copytree(runs / RUN, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["update"]["lr"] = lr
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if "reward/mean" in r:
            r["reward/mean"] += 0.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def read_metrics(run: Path) -> list[dict]:
    """One row per step (a checkpoint's record, a second row of its step, merged in)."""
    from forge.tracking import read_metrics as read

    return read(run / "metrics.jsonl")


# what `forgeweave dashboard` gives the app (dashboard/login.py): the user and a digest of its password, and the URL
# token; a page test signs in with the token
USER, PASSWORD = "forgeweave", "test-password"
LOGIN = {"FORGEWEAVE_DASHBOARD_LOGIN": f"{USER}:{login_digest(PASSWORD, salt=b'test-salt')}",
         "FORGEWEAVE_DASHBOARD_TOKEN": "test-token"}  # fmt: skip


def open_app(runs: Path, monkeypatch, token: str | None = None) -> AppTest:
    """The app on `runs` through its router, with the login set up as `forgeweave dashboard` does; opened with
    `?token=TOKEN` when given (not run yet)."""
    monkeypatch.setenv("FORGEWEAVE_RUNS_DIR", str(runs))
    for key, value in LOGIN.items():
        monkeypatch.setenv(key, value)
    at = AppTest.from_file(str(APP), default_timeout=60)
    if token is not None:
        at.query_params["token"] = token
    return at


def open_page(runs: Path, monkeypatch, page: str | None = None) -> AppTest:
    """Run the app on `runs` (through its router, signed in with the URL token), switch to views/<page>.py, and
    check nothing raised."""
    at = open_app(runs, monkeypatch, LOGIN["FORGEWEAVE_DASHBOARD_TOKEN"]).run()
    if page:
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def charts(at: AppTest) -> dict[str, list]:
    """Title -> the data frames of each Vega-Lite chart on the page (decoded from the Arrow datasets)."""
    out = {}
    for el in at.get("vega_lite_chart"):
        spec = json.loads(el.proto.spec)
        title = spec.get("title")
        title = title.get("text") if isinstance(title, dict) else title
        out[title] = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in el.proto.datasets]
    return out


def texts(at: AppTest) -> str:
    """Every caption, markdown, info, warning, error, success and code text on the page, joined."""
    kinds = (at.caption, at.markdown, at.info, at.warning, at.error, at.success, at.code)
    return "\n".join(str(el.value) for kind in kinds for el in kind)


@pytest.fixture(scope="session")
def mlflow_store_dir(tiny_run, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A runs dir with a copy of the tiny run and an embedded MLflow store (sqlite) laid out as the tracker writes
    it: the run tagged with its directory, plus a newer untagged run of the same name and one of another name."""
    from mlflow.tracking import MlflowClient

    runs = tmp_path_factory.mktemp("dash-mlflow") / "runs"
    shutil.copytree(tiny_run, runs / RUN)
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    exp = client.create_experiment("forgeweave", artifact_location=str(runs / "mlflow-artifacts"))
    made = {
        "tagged": client.create_run(exp, 1000, {"forgeweave.run_dir": str((runs / RUN).resolve())}, run_name=RUN),
        "decoy": client.create_run(exp, 2000, {}, run_name=RUN),
        "untagged": client.create_run(exp, 3000, {}, run_name="other"),
    }
    return runs, {k: r.info.run_id for k, r in made.items()}
