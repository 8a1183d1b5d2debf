"""Issue 46: `forgeweave server` and `forgeweave mlflow` started on their own (no `up`) ask for the runs dir's stack
credentials as `up`'s servers do, print where the file is, and the clients forgeweave starts for that runs dir
(`serve`, `run`, the tracker, the dashboard) get them while the server runs, other URLs never."""

from __future__ import annotations

import stat

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


def test_mlflow_alone_asks_for_the_stack_credentials(tmp_path):
    runs = tmp_path / "runs"
    with server_alone("mlflow", runs, tmp_path / "mlflow.log") as url:
        creds = _check_credentials_file(runs, tmp_path / "mlflow.log")
        assert_mlflow_asks_for_its_user(url, creds)
        assert stack.credentials_for(runs, url) == creds.mlflow_env()
        assert (runs / "mlflow.db").is_file()  # the embedded store, served
