"""The local stack's credentials without starting a stack (tests/flows/test_stack.py checks them against the real
servers): made once and owner-only, reused, handed to the services that need them and to no other, picked up by
`forgeweave run` and the tracker only for this runs dir's servers, and MLflow's admin password set to them."""

from __future__ import annotations

import base64
import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flows import stack, stack_auth
from flows.tracking import mlflow_tracker
from forge.errors import UserError

CLIENT_VARS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


@pytest.fixture(autouse=True)
def no_client_settings(monkeypatch):
    """Neither the URLs nor the credentials of some other server in the environment (teardown restores them)."""
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", *CLIENT_VARS):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_credentials_are_made_once_owner_only_and_reused(tmp_path):
    state_dir = tmp_path / ".stack"
    creds, fresh = stack_auth.ensure_credentials(state_dir)
    path = state_dir / "auth" / "credentials.env"
    assert fresh and _mode(path) == 0o600 and _mode(path.parent) == 0o700
    user, password = creds.prefect_auth_string.split(":", 1)
    assert user == "forgeweave" and len(password) >= 32  # token_urlsafe(24): 192 random bits
    assert len(creds.mlflow_password) >= 32 and creds.mlflow_password not in (password, "password1234")
    assert set(path.read_text().splitlines()[1:]) == {f"{k}={v}" for k, v in creds.env().items()}

    path.chmod(0o644)  # widened by hand (or copied in): narrowed again, same credentials
    path.parent.chmod(0o755)
    again, fresh = stack_auth.ensure_credentials(state_dir)
    assert again == creds and not fresh
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700

    path.unlink()  # gone: new ones
    assert stack_auth.ensure_credentials(state_dir)[0] != creds


def test_mlflow_server_gets_its_auth_config_and_the_generated_admin_password(tmp_path):
    state_dir = tmp_path / ".stack"
    creds, fresh = stack_auth.ensure_credentials(state_dir)
    env = stack_auth.mlflow_server_env(state_dir, creds, fresh)
    ini = state_dir / "auth" / "mlflow-auth.ini"
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == str(ini) and _mode(ini) == 0o600
    assert env["MLFLOW_AUTH_ADMIN_USERNAME"] == creds.mlflow_username
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == creds.mlflow_password
    assert len(env["MLFLOW_FLASK_SERVER_SECRET_KEY"]) == 64
    text = ini.read_text()
    assert f"database_uri = sqlite:///{state_dir / 'auth' / 'mlflow-auth.db'}" in text
    assert "admin_password" not in text  # the password is only in the credentials file and the server's environment


def test_mlflow_reads_the_config_as_written(tmp_path, monkeypatch):
    """MLflow's own reader of the auth config (it imports the basic-auth app, which needs Flask-WTF)."""
    pytest.importorskip("flask_wtf", reason="mlflow[auth] (Flask-WTF) is not installed")
    from mlflow.server.auth.config import read_auth_config

    state_dir = tmp_path / ".stack"
    creds, fresh = stack_auth.ensure_credentials(state_dir)
    for key, value in stack_auth.mlflow_server_env(state_dir, creds, fresh).items():
        monkeypatch.setenv(key, value)
    config = read_auth_config()
    assert (config.admin_username, config.admin_password) == (creds.mlflow_username, creds.mlflow_password)
    assert config.database_uri == f"sqlite:///{state_dir / 'auth' / 'mlflow-auth.db'}"


def test_new_credentials_reset_the_admin_password_of_an_existing_user_db(tmp_path):
    """The credentials file was deleted, MLflow's user database kept: the admin's password there becomes the new
    one (MLflow itself reads MLFLOW_AUTH_ADMIN_PASSWORD only when it creates the user)."""
    pytest.importorskip("flask_wtf", reason="mlflow[auth] (Flask-WTF) is not installed")
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    state_dir = tmp_path / ".stack"
    old, fresh = stack_auth.ensure_credentials(state_dir)
    db = f"sqlite:///{state_dir / 'auth' / 'mlflow-auth.db'}"
    store = SqlAlchemyStore()
    store.init_db(db)
    store.create_user(old.mlflow_username, old.mlflow_password, is_admin=True)
    stack_auth.credentials_path(state_dir).unlink()
    new, fresh = stack_auth.ensure_credentials(state_dir)
    stack_auth.mlflow_server_env(state_dir, new, fresh)
    assert store.authenticate_user(new.mlflow_username, new.mlflow_password)
    assert not store.authenticate_user(old.mlflow_username, old.mlflow_password)
    for role, user in stack_auth.ROLES.items():  # the run and viewer users: made, with the new derived passwords
        assert store.authenticate_user(user, new.role_password(role)) and not store.get_user(user).is_admin
        assert not store.authenticate_user(user, old.role_password(role))
    assert len({new.mlflow_password, new.role_password("run"), new.role_password("viewer")}) == 3


def test_services_get_the_credentials_they_need_and_no_others(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "someone:else")  # the user's, for another server
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "another-servers-password")
    cfg = stack.StackConfig(tmp_path / "runs")
    creds, fresh = stack_auth.ensure_credentials(cfg.state_dir)
    mlflow_auth = stack_auth.mlflow_server_env(cfg.state_dir, creds, fresh)
    svc = stack.services(cfg, creds, mlflow_auth)
    assert svc["prefect"].env["PREFECT_SERVER_API_AUTH_STRING"] == creds.prefect_auth_string
    argv = svc["mlflow"].argv
    assert argv[argv.index("--app-name") + 1] == "basic-auth"
    assert mlflow_auth.items() <= svc["mlflow"].env.items()
    # a client of both (the eval button, MLflow reads): MLflow's read-only user, never the admin's password
    assert {**creds.prefect_env(), **creds.role_env("viewer")}.items() <= svc["dashboard"].env.items()
    assert creds.mlflow_password not in svc["dashboard"].env.values()
    # serve: a UI "Run" needs the Prefect API; its tracker takes MLflow's for the stack's server only (issue 46)
    assert creds.prefect_env().items() <= svc["serve"].env.items()
    assert not {k for k in creds.mlflow_env() if k in svc["serve"].env}
    assert svc["serve"].health_auth == "prefect"
    for name in ("prefect", "mlflow", "ray"):  # no client credentials where no client runs
        assert not {k for k in CLIENT_VARS if k in svc[name].env}, name
    assert all("someone:else" not in s.env.values() for s in svc.values())


def test_run_and_tracker_take_the_credentials_only_for_this_stacks_servers(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    me = {"pid": os.getpid(), "start": stack.start_time(os.getpid())}  # a live process stands in for the servers
    env = {"PREFECT_API_URL": "http://127.0.0.1:1/api", "MLFLOW_TRACKING_URI": "http://127.0.0.1:2"}
    stack.write_state(runs, {"services": {"prefect": me, "mlflow": me}, "env": env})
    assert stack.credentials_for(runs, env["MLFLOW_TRACKING_URI"]) == {}  # no credentials file: nothing to take
    creds, _ = stack_auth.ensure_credentials(runs / ".stack")
    assert stack.credentials_for(runs, "http://127.0.0.1:2/") == creds.role_env("run")  # runs: the run user
    assert stack.credentials_for(runs, "http://127.0.0.1:2/", role="viewer") == creds.role_env("viewer")
    assert stack.credentials_for(runs, "http://127.0.0.1:1/api") == creds.prefect_env()
    assert stack.credentials_for(runs, "http://elsewhere:5000") == {}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")  # the user's server: not given ours
    assert stack.use_stack(str(runs)) == {"PREFECT_API_URL": env["PREFECT_API_URL"]}
    assert os.environ["PREFECT_API_AUTH_STRING"] == creds.prefect_auth_string
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ

    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the stack's MLflow then: its URL is taken, its credentials are not
    monkeypatch.delenv("PREFECT_API_URL")  # (a config's tracking.uri may name another server: the tracker decides)
    assert stack.use_stack(str(runs)) == env
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ and "MLFLOW_TRACKING_USERNAME" not in os.environ

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "me")  # set by the user: it wins
    mlflow_tracker._stack_credentials(runs, env["MLFLOW_TRACKING_URI"])
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "me"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == creds.role_password("run")
    mlflow_tracker._stack_credentials(tmp_path / "nowhere", "http://127.0.0.1:2")  # no stack there: nothing, no error


def test_up_refuses_new_credentials_while_the_stack_runs(tmp_path):
    cfg = stack.StackConfig(tmp_path / "runs")
    me = {"pid": os.getpid(), "start": stack.start_time(os.getpid())}
    with pytest.raises(UserError, match=r"credentials.env is missing while the stack runs \(prefect\)"):
        stack._credentials(cfg, {"services": {"prefect": me}})
    assert not stack_auth.credentials_path(cfg.state_dir).exists()


class _BasicAuthOnly(BaseHTTPRequestHandler):
    expected = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        ok = self.headers.get("Authorization") == self.expected
        self.send_response(200 if ok else 401)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_health_check_of_serve_sends_the_prefect_credentials(tmp_path):
    creds, _ = stack_auth.ensure_credentials(tmp_path)
    _BasicAuthOnly.expected = "Basic " + base64.b64encode(creds.prefect_auth_string.encode()).decode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BasicAuthOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rec = {"health": f"http://127.0.0.1:{server.server_address[1]}/api/deployments/x", "health_auth": "prefect"}
        assert stack.healthy(rec, creds)
        assert not stack.healthy(rec, None) and not stack.healthy({**rec, "health_auth": ""}, creds)
    finally:
        server.shutdown()
        server.server_close()
