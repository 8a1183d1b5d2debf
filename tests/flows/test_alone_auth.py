"""Issue 46: `forgeweave server` and `forgeweave mlflow` started on their own (no `up`) ask for the runs dir's stack
credentials as `up`'s servers do, print where the file is, and the clients forgeweave starts for that runs dir
(`serve`, `run`, the tracker, the dashboard) get them while the server runs, other URLs never."""

from __future__ import annotations

import stat

import pytest

from flows import stack, stack_auth
from tests.stack_helpers import assert_mlflow_asks_for_its_user, http_status, server_alone


def _check_credentials_file(runs, log) -> stack_auth.Credentials:
    path = runs / ".stack" / "auth" / "credentials.env"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((runs / ".stack").stat().st_mode) == 0o700
    creds = stack_auth.read_credentials(runs / ".stack")
    out = log.read_text()
    assert f"credentials: {path} (owner-only" in out, out
    assert creds.mlflow_password not in out and creds.prefect_auth_string.split(":")[1] not in out
    return creds


def test_prefect_server_alone_asks_for_the_stack_credentials(tmp_path):
    runs = tmp_path / "runs"
    with server_alone("server", runs, tmp_path / "server.log") as url:
        creds = _check_credentials_file(runs, tmp_path / "server.log")
        api = f"{url}/api"
        user, password = creds.prefect_auth_string.split(":", 1)
        for headers in ({}, stack_auth.basic_auth_header(user, "wrong-password")):
            assert http_status(f"{api}/flow_runs/filter", headers, body={}) == 401
            assert http_status(f"{api}/deployments/filter", headers, body={}) == 401
        assert http_status(f"{api}/flow_runs/filter", stack_auth.prefect_header(creds), body={}) == 200
        # the clients of this runs dir get the auth string for this server, and only while it runs
        assert stack.credentials_for(runs, api) == creds.prefect_env()
        assert stack.credentials_for(runs, url.replace("127.0.0.1", "localhost") + "/api") == {}
        assert stack.credentials_for(tmp_path / "elsewhere", api) == {}
        # up's Prefect server for this runs dir: its database and home under <runs>/.stack
        assert (runs / ".stack" / "prefect.db").is_file() and (runs / ".stack" / "prefect-home").is_dir()
    assert stack.credentials_for(runs, api) == {}  # stopped: a process that takes the port later gets nothing


def test_mlflow_alone_asks_for_the_stack_credentials(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    with server_alone("mlflow", runs, tmp_path / "mlflow.log") as url:
        creds = _check_credentials_file(runs, tmp_path / "mlflow.log")
        assert_mlflow_asks_for_its_user(url, creds)
        assert (runs / "mlflow.db").is_file()  # the embedded store, served
        # least privilege: a run's tracker gets the run user, the dashboard the read-only one, never the admin
        assert stack.credentials_for(runs, url) == creds.role_env("run")
        assert stack.credentials_for(runs, url, role="viewer") == creds.role_env("viewer")
        _check_roles(url, creds, monkeypatch)
        _check_tracker_refused(url, runs, monkeypatch, capsys)


def _as(monkeypatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _check_roles(url: str, creds: stack_auth.Credentials, monkeypatch) -> None:
    """What each MLflow user may do: the run user writes where it made the experiment and reads the rest, manages no
    user; the viewer reads."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(url)
    _as(monkeypatch, creds.mlflow_env())
    theirs = client.create_experiment("the-persons")  # made by the admin (the person)
    _as(monkeypatch, creds.role_env("run"))
    ours = client.create_experiment("runs")
    assert client.create_run(ours).info.experiment_id == ours
    assert {e.name for e in client.search_experiments()} >= {"the-persons", "runs"}
    for role, experiment in (("run", theirs), ("viewer", ours)):
        _as(monkeypatch, creds.role_env(role))
        with pytest.raises(MlflowException) as refused:
            client.create_run(experiment)
        assert refused.value.error_code == "PERMISSION_DENIED", (role, refused.value)
    run = stack_auth.basic_auth_header(*creds.role_env("run").values())
    new_user = {"username": "intruder", "password": "a-long-password-1234"}
    assert http_status(f"{url}/api/2.0/mlflow/users/create", run, body=new_user) == 403
    viewer = stack_auth.basic_auth_header(*creds.role_env("viewer").values())
    assert http_status(f"{url}/api/2.0/mlflow/experiments/search?max_results=5", viewer) == 200


def _check_tracker_refused(url: str, runs, monkeypatch, capsys) -> None:
    """A run told to log into the admin's experiment: the run goes on, and the warning says what to do."""
    from flows.tracking.mlflow_tracker import tracker_for_run
    from forge.config import RunConfig

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)
    cfg = RunConfig()
    cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.finish_timeout_s = url, "the-persons", 20
    (runs / "refused").mkdir()
    tracker = tracker_for_run(cfg, runs / "refused")
    tracker.log_params({"lr": 1e-5})
    tracker.finish("FINISHED")
    err = capsys.readouterr().err
    assert "MLflow user forgeweave-run may not write to experiment 'the-persons' (another user made it)" in err, err
