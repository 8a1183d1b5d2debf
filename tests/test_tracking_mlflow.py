"""MLflow as the system of record: what a real run leaves in the store, and nothing lost while the store is away.

The tracker tests use a real sqlite MLflow store (copied from one migrated once per session: creating one costs
seconds); the end-to-end tests run `forgeweave run` on the tiny preset, one of them against a real
`forgeweave mlflow` server on 127.0.0.1 that the test stops mid-run and starts again.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient

from flows.cli import main
from flows.stack_auth import read_credentials
from flows.tracking.mlflow_tracker import default_uri, tracker_for_run
from forge.config import RunConfig
from forge.rundir import git_commit
from tests.episode_samples import OBSERVATION, TURNS, UNKNOWN_TOOL, write_tool_episodes
from tests.servers import stop

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=default_uri(path.parent)).search_experiments()  # creates the tables
    return path


@pytest.fixture
def store(tmp_path, migrated_db):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(migrated_db, runs / "mlflow.db")
    return runs


def _tracker(runs: Path, name: str = "r"):
    cfg = RunConfig(preset="tiny")
    cfg.tracking.uri = default_uri(runs)
    cfg.tracking.finish_timeout_s = 30
    (runs / name).mkdir(exist_ok=True)
    return tracker_for_run(cfg, runs / name), cfg.tracking.uri


class Flaky:
    """An MlflowClient whose every call fails like an unreachable server while `down` is set."""

    def __init__(self, client):
        self.client, self.down, self.failures = client, False, 0

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            if self.down:
                self.failures += 1
                raise ConnectionError("connection refused (simulated)")
            return method(*args, **kwargs)

        return call


def _wait_delivered(tracker, uri: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while tracker.outbox.pending(tracker.outbox.load_state(uri)) and time.time() < deadline:
        time.sleep(0.05)
    assert not tracker.outbox.pending(tracker.outbox.load_state(uri)), "outbox not drained"


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_outage_then_automatic_recovery_loses_nothing_and_duplicates_nothing(store):
    tracker, uri = _tracker(store)
    tracker._start()  # the sender thread is idle until the first record; give it a client that can fail
    flaky = Flaky(MlflowClient(tracking_uri=uri, registry_uri=uri))
    tracker.worker.sender.client = flaky
    tracker.log_params({"update.lr": 0.001, "steps": 12})
    for step in range(1, 4):
        tracker.log_metrics({"reward/mean": step / 10, "eval/pass@1": step / 100}, step=step)
    _wait_delivered(tracker, uri)

    flaky.down = True
    for step in range(4, 9):  # the store is away: each call only appends to the outbox
        t0 = time.perf_counter()
        tracker.log_metrics({"reward/mean": step / 10}, step=step)
        assert time.perf_counter() - t0 < 0.5
    deadline = time.time() + 10
    while flaky.failures == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert flaky.failures > 0  # it really tried and failed
    assert len(tracker.outbox.pending(tracker.outbox.load_state(uri))) == 5

    flaky.down = False  # back: the next attempt (backoff <= 2 s here) sends the backlog without being asked
    _wait_delivered(tracker, uri, timeout=20)
    for step in range(9, 13):
        tracker.log_metrics({"reward/mean": step / 10}, step=step)
    tracker.finish("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    run_id = tracker.info()["mlflow_run_id"]
    assert _history(client, run_id, "reward/mean") == [(s, pytest.approx(s / 10)) for s in range(1, 13)]
    assert _history(client, run_id, "eval/pass_at_1") == [(s, pytest.approx(s / 100)) for s in range(1, 4)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params["update.lr"] == "0.001"
    assert run.data.tags["forgeweave.run_dir"] == str((store / "r").resolve())


def test_resend_and_resume_leave_no_duplicates(store):
    """A crash after delivery but before the cursor was saved resends records; a resumed run redoes steps."""
    tracker, uri = _tracker(store)
    ckpt = store / "r" / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text("{}")  # resume state: not logged
    tracker.set_tags({"forgeweave.dataset_hash": "abc123"})
    for step in range(1, 7):
        tracker.log_metrics({"reward/mean": step / 10}, step=step)
        tracker.log_table("samples", step, [{"prompt": "1+1=", "completion": "2", "scores": {"math_answer": 1.0}}])
        if step == 4:
            tracker.register_checkpoint(ckpt, step, 0.5)
    tracker.finish("FAILED")  # say the run was killed after step 6, its checkpoint at step 4
    run_id = tracker.info()["mlflow_run_id"]

    state = json.loads((store / "r" / "mlflow_state.json").read_text())
    state.update(sent=-1, offset=0)  # the cursor never got saved: everything is sent again
    (store / "r" / "mlflow_state.json").write_text(json.dumps(state))
    resumed, _ = _tracker(store)  # `--resume` from step 4: steps 5 and 6 come again, then 7 and 8
    for step in range(5, 9):
        resumed.log_metrics({"reward/mean": step / 10}, step=step)
    resumed.finish("FINISHED")

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert resumed.info()["mlflow_run_id"] == run_id
    runs = client.search_runs([client.get_experiment_by_name("forgeweave").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert _history(client, run_id, "reward/mean") == [(s, pytest.approx(s / 10)) for s in range(1, 9)]
    versions = client.search_model_versions("name = 'forgeweave-tiny'")
    assert len(versions) == 1
    mv = versions[0]
    assert mv.source == f"runs:/{run_id}/checkpoints/step-000004"
    assert mv.tags["forgeweave.step"] == "4" and mv.tags["forgeweave.dataset_hash"] == "abc123"
    assert mv.tags["forgeweave.eval_pass_at_1"] == "0.5" and mv.tags["forgeweave.run_name"] == "r"
    logged = {a.path for a in client.list_artifacts(run_id, "checkpoints/step-000004")}
    assert logged == {"checkpoints/step-000004/config.json"}  # the optimizer state stays in the run dir
    table = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path="samples/step-000006.json", tracking_uri=uri
            )
        ).read_text()
    )
    assert table["columns"] == ["prompt", "completion", "scores.math_answer"]
    assert table["data"] == [["1+1=", "2", 1.0]]


def _table(run_id: str, uri: str, path: str) -> dict:
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, tracking_uri=uri)
    return json.loads(Path(local).read_text())


def test_a_multiturn_sample_table_carries_the_transcript(store, tmp_path):
    """Rows forge writes for tool-calling episodes (tests.episode_samples): the transcript as text, one block per
    segment headed by role, tool name and error (the first: the environment's reset observation), and as JSON; the episode's figures as columns. A single-turn
    step's table keeps its columns."""
    tracker, uri = _tracker(store)
    rows = write_tool_episodes(tmp_path, step=3)
    tracker.log_table("samples", 3, rows)
    tracker.log_table("samples", 4, [{"step": 4, "prompt": "1+1=", "completion": "2", "scores": {"math_answer": 1.0}}])
    tracker.finish("FINISHED")
    run_id = tracker.info()["mlflow_run_id"]

    table = _table(run_id, uri, "samples/step-000003.json")
    figures = ["episode.turns", "episode.tool_calls", "episode.tool_errors", "episode.truncated", "episode.masked"]
    base = ["step", "prompt", "answer", "completion", "scores.sum_reward", "reward", "advantage"]
    lag = ["zero_std_group", "policy_version"]  # no staleness: write_tool_episodes gave no trainer version
    assert table["columns"] == [*base, *lag, "transcript", *figures, "transcript_json"]  # no tokens: samples.jsonl's
    row = dict(zip(table["columns"], table["data"][0], strict=True))
    assert [row[f] for f in figures] == [3, 2, 1, False, False] and [row[c] for c in lag] == [True, 2]
    assert json.loads(row["transcript_json"]) == rows[0]["transcript"]
    assert row["transcript"].split("\n\n") == [
        f"[environment]\n{OBSERVATION}",  # reset's first observation (issue 44)
        f"[assistant · policy v2]\n{TURNS[0]}",
        "[tool check]\nwrong",
        f"[assistant · policy v2]\n{TURNS[1]}",
        f"[tool peek · error]\n{UNKNOWN_TOOL}",
        "[assistant · policy v2]\n9",
    ]
    frame = pd.DataFrame(table["data"], columns=table["columns"])  # orient="split": one scalar per cell
    assert frame["episode.tool_errors"].tolist() == [1, 1] and frame["transcript"].map(type).tolist() == [str, str]
    single = _table(run_id, uri, "samples/step-000004.json")
    assert single["columns"] == ["step", "prompt", "completion", "scores.math_answer"]
    assert single["data"] == [[4, "1+1=", "2", 1.0]]


def test_a_rejected_record_is_skipped_alone(store):
    """`--resume --set update.lr=...` changes a logged param: MLflow refuses that one record; the metrics sent
    in the same window still arrive, and the refusal is listed in mlflow_state.json."""
    first, uri = _tracker(store)
    first.log_params({"update.lr": 0.001})
    first.log_metrics({"reward/mean": 0.1}, step=1)
    first.finish("FAILED")
    resumed, _ = _tracker(store)
    resumed.log_params({"update.lr": 0.0005})
    resumed.log_metrics({"reward/mean": 0.2}, step=2)
    resumed.finish("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(resumed.info()["mlflow_run_id"])
    assert run.data.params["update.lr"] == "0.001" and run.info.status == "FINISHED"
    assert _history(client, run.info.run_id, "reward/mean") == [(1, 0.1), (2, 0.2)]
    state = json.loads((store / "r" / "mlflow_state.json").read_text())
    assert [s["op"] for s in state["skipped"]] == ["params"] and "update.lr" in state["skipped"][0]["error"]
    assert resumed.outbox.pending(state) == []


# ---------------------------------------------------------------- end to end


TINY = ["steps=6", "eval.every=3", "checkpoint.every=3", "eval.k=0", "rollout.prompts_per_step=8"]


def _sets(settings):
    return [a for s in settings for a in ("--set", s)]


@pytest.mark.slow
def test_run_is_recorded_in_default_store(runs_dir, monkeypatch):
    """Acceptance 1: `forgeweave run --preset tiny` (through Prefect) -> the run, found by name in the embedded
    store, has the config params, one point per step per metric, eval pass@1 and its checkpoints registered."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["run", "--preset", "tiny", "--name", "t", "--runs-dir", str(runs_dir), "--quiet", *_sets(TINY)]) == 0
    run_dir = (runs_dir / "t").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    uri = default_uri(runs_dir)
    assert (runs_dir / "mlflow.db").is_file()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what a user does to query the embedded store
    found = mlflow.search_runs(
        experiment_names=["forgeweave"], filter_string="attributes.run_name = 't'", output_format="list"
    )
    assert len(found) == 1
    run = found[0]
    assert run.info.run_id == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.info.artifact_uri == (runs_dir / "mlartifacts").resolve().as_uri() + f"/{run.info.run_id}/artifacts"
    params, tags = run.data.params, run.data.tags
    assert params["steps"] == "6" and params["update.lr"] == "0.001" and params["rollout.prompts_per_step"] == "8"
    assert params["reward.verifiers"] == '["math_answer"]'
    manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert tags["forgeweave.dataset_hash"] == manifest["content_hash"]
    assert tags["forgeweave.run_dir"] == str(run_dir) and tags["forgeweave.preset"] == "tiny"
    assert tags["forgeweave.model"] == "tiny-random"
    assert tags["forgeweave.prefect_flow_run_id"] == summary["prefect_flow_run_id"]
    commit = git_commit()  # "" when the tests run outside a git checkout
    assert tags.get("forgeweave.git_commit", "") == commit and (not commit or len(commit) == 40)

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in (
        "reward/mean",
        "train/loss",
        "train/kl_old",
        "train/kl_ref",
        "perf/rollout_tokens_per_s",
        "time/update_s",
    ):
        expected = [(r["step"], pytest.approx(r[key])) for r in rows if key in r]
        assert [s for s, _ in expected] == [1, 2, 3, 4, 5, 6]
        assert _history(client, run.info.run_id, key) == expected, key
    evals = {s: json.loads((run_dir / "eval" / f"step-{s:06d}.json").read_text())["pass@1"] for s in (0, 3, 6)}
    assert _history(client, run.info.run_id, "eval/pass_at_1") == [(s, pytest.approx(v)) for s, v in evals.items()]

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "plan.json", "summary.json", "data", "eval", "samples", "checkpoints"} <= artifacts
    assert len(client.list_artifacts(run.info.run_id, "samples")) == 6
    versions = sorted(client.search_model_versions("name = 'forgeweave-tiny'"), key=lambda v: int(v.version))
    assert [v.tags["forgeweave.step"] for v in versions] == ["3", "6"]
    for v in versions:
        step = int(v.tags["forgeweave.step"])
        assert v.run_id == run.info.run_id and v.tags["forgeweave.run_name"] == "t"
        assert v.tags["forgeweave.dataset_hash"] == manifest["content_hash"]
        assert float(v.tags["forgeweave.eval_pass_at_1"]) == pytest.approx(evals[step])
        model_dir = Path(mlflow.artifacts.download_artifacts(f"models:/forgeweave-tiny/{v.version}", tracking_uri=uri))
        assert (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """`python -m flows.cli ARGS`, without this process's MLflow credentials (a run or `sync` of a runs dir whose
    server asks for them takes them from the runs dir itself)."""
    own = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    env = {**own, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _start_server(runs_dir: Path, port: int) -> subprocess.Popen:
    """`forgeweave mlflow` in its own process group (it replaces itself with `mlflow server` + a worker); it asks for
    the runs dir's stack credentials (<runs>/.stack/auth/credentials.env, made by the first start)."""
    server = _cli("mlflow", "--runs-dir", str(runs_dir), "--port", str(port), start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert server.poll() is None, server.stderr.read()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.3)
    _stop_server(server)
    raise AssertionError("mlflow server did not come up within 120 s")


def _stop_server(server: subprocess.Popen) -> None:
    stop(server)
    deadline = time.time() + 10  # the worker process of the group exits right after the server
    while time.time() < deadline:
        try:
            os.killpg(server.pid, 0)
            time.sleep(0.2)
        except ProcessLookupError:
            return


def _server_steps(client, name: str, key: str) -> list[int]:
    try:
        exp = client.get_experiment_by_name("forgeweave")
        runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
        return [m.step for m in client.get_metric_history(runs[0].info.run_id, key)] if runs else []
    except Exception:
        return []


@pytest.mark.slow
def test_server_outage_mid_run_then_sync_delivers_everything(runs_dir, monkeypatch):
    """Acceptance 2: stop the MLflow server mid-run: training goes on; once the server is back,
    `forgeweave sync` sends the rest and the server has every step's metrics exactly once. The server asks for the
    runs dir's credentials: the run and `sync` take them themselves, this test's client from the file."""
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    server = _start_server(runs_dir, port)
    for key, value in read_credentials(runs_dir / ".stack").mlflow_env().items():
        monkeypatch.setenv(key, value)
    settings = [
        "steps=14",
        "eval.every=5",
        "checkpoint.every=5",
        "eval.k=0",
        "threads=1",
        "checkpoint.keep_last=3",
        "reward.verifiers=[tests.slow_verifiers:slow_math]",  # 0.4 s per step: time to stop the server
    ]
    try:
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        args = ["run", "--preset", "tiny", "--name", "o", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
        train = _cli(*args, *_sets(settings), env={"MLFLOW_TRACKING_URI": uri})
        deadline = time.time() + 180
        while len(_server_steps(client, "o", "reward/mean")) < 2 and time.time() < deadline:
            assert train.poll() is None, train.stderr.read()[-3000:]
            time.sleep(0.2)
        _stop_server(server)
        assert train.poll() is None, "the run ended before the server was stopped: nothing to test"
        out, err = train.communicate(timeout=300)
        assert train.returncode == 0, err[-3000:]
    finally:
        if server.poll() is None:
            _stop_server(server)

    run_dir = runs_dir / "o"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 14 and json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert "forgeweave sync" in err  # the run said what was left and how to send it
    state = json.loads((run_dir / "mlflow_state.json").read_text())
    assert state["run_id"] == summary["mlflow_run_id"]
    last_seq = json.loads((run_dir / "mlflow_outbox.jsonl").read_text().splitlines()[-1])["seq"]
    assert state["sent"] < last_seq  # records really waited in the outbox

    server = _start_server(runs_dir, port)
    try:
        sync = _cli("sync", "o", "--runs-dir", str(runs_dir))
        out, err = sync.communicate(timeout=120)
        assert sync.returncode == 0, err[-3000:]
        assert summary["mlflow_run_id"] in out
        run = client.get_run(summary["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        expected = [(r["step"], pytest.approx(r["reward/mean"])) for r in rows if "reward/mean" in r]
        assert _history(client, run.info.run_id, "reward/mean") == expected
        assert [s for s, _ in expected] == list(range(1, 15))
        assert [s for s, _ in _history(client, run.info.run_id, "eval/pass_at_1")] == [0, 5, 10, 14]
        versions = client.search_model_versions("name = 'forgeweave-tiny'")
        assert sorted(int(v.tags["forgeweave.step"]) for v in versions) == [5, 10, 14]
        again = _cli("sync", "o", "--runs-dir", str(runs_dir))
        out, _ = again.communicate(timeout=120)
        assert again.returncode == 0 and "sent 0 records" in out
        assert len(client.get_metric_history(run.info.run_id, "reward/mean")) == 14
    finally:
        _stop_server(server)


def test_sync_of_untracked_run_is_one_line(runs_dir, capsys):
    (runs_dir / "plain").mkdir(parents=True)
    assert main(["sync", "plain", "--runs-dir", str(runs_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("forgeweave: error: ") and "mlflow_outbox.jsonl" in err and "\n" not in err
