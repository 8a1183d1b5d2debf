"""`forgeweave up` / `status` / `down` for real (every port a non-default one), with SQLite and with a private
PostgreSQL cluster; plus the PID bookkeeping and the one-line errors, without starting a stack."""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flows import stack, stack_auth
from forge.errors import UserError
from tests.servers import REPO
from tests.stack_helpers import (
    assert_mlflow_asks_for_its_user,
    cli,
    http_status,
    port_args,
    process_trees,
    running_stack,
    stack_sockets,
)

SERVICES = {"prefect", "mlflow", "dashboard", "ray", "serve"}


def _get_json(url: str, headers: dict | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return json.loads(r.read())


def _assert_all_gone(trees: dict[str, dict[int, int]], ports: set[int], runs: Path) -> None:
    left = {name: [p for p, t in tree.items() if stack.start_time(p) == t] for name, tree in trees.items()}
    assert not any(left.values()), f"processes left behind: {left}"
    assert all(stack.port_free(p) for p in ports), [p for p in ports if not stack.port_free(p)]
    assert not (runs / ".stack" / "stack.json").exists()
    assert cli(["status", "--runs-dir", str(runs)]).returncode == 3  # nothing recorded any more


def test_up_status_down_sqlite(tmp_path):
    runs = tmp_path / "runs"
    with running_stack(runs) as state:
        assert set(state["services"]) == SERVICES and state["db"] == "sqlite"
        ports = {name: port for name, port in state["ports"].items() if name != "postgres"}
        assert not set(ports.values()) & {4200, 5000, 8501, 6379}
        for name in SERVICES - {"serve"}:
            assert state["services"][name]["port"] == ports[name]
            assert f"{name:<10} healthy" in state["up_stdout"]
        state_file = runs / ".stack" / "stack.json"
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
        assert all(stack.alive(rec) for rec in state["services"].values())

        status = cli(["status", "--runs-dir", str(runs)])
        assert status.returncode == 0, status.stdout
        assert status.stdout.count(" healthy ") == 5
        env = cli(["status", "--env", "--runs-dir", str(runs)]).stdout
        assert f"export PREFECT_API_URL=http://127.0.0.1:{ports['prefect']}/api" in env
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{ports['mlflow']}" in env

        # the UI served on the non-default port asks its API on that port (not 127.0.0.1:4200)
        ui = _get_json(f"http://127.0.0.1:{ports['prefect']}/ui-settings")
        assert ui["api_url"] == f"http://127.0.0.1:{ports['prefect']}/api"
        assert ui["auth"] == "BASIC"  # the UI asks for the auth string on its login page
        creds = stack_auth.read_credentials(runs / ".stack")
        deployment = _get_json(
            f"{state['env']['PREFECT_API_URL']}/deployments/name/forgeweave-grpo/pipeline",
            stack_auth.prefect_header(creds),
        )
        assert deployment["parameters"]["runs_dir"] == str(runs.resolve())
        _check_auth(runs, state, creds, deployment["id"])
        _check_secrets_private(runs, state)

        # DNS rebinding: the dashboard's WebSocket (all of its data) opens for its own names only
        dash = ports["dashboard"]
        for host, code in (("127.0.0.1", 101), ("localhost", 101), ("rebound.example", 403)):
            assert _websocket_status(dash, f"{host}:{dash}") == code, host

        # every listening socket of every process of the stack is on 127.0.0.1, each service's port among them
        sockets = stack_sockets(state)
        assert {addr for addr, _ in sockets} == {"127.0.0.1"}, sockets
        assert set(ports.values()) <= {port for _, port in sockets}

        # a driver reaches the Ray head at the printed address; it offers the pools Weaver autodetects here
        probe = (
            "import json, ray; ray.init(address=%r, log_to_driver=False); print(json.dumps(ray.cluster_resources()))"
        )
        ray_addr = state["services"]["ray"]["url"]
        env = {**os.environ, **state["ray_env"]}  # the head's auth token
        proc = subprocess.run(
            [sys.executable, "-c", probe % ray_addr], env=env, capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["pool:cpu"] == 1000.0
        assert f"orchestration.ray_address={ray_addr}" in state["up_stdout"]

        again = cli(["up", "--runs-dir", str(runs), *_same_ports(state)])
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
        assert json.loads(state_file.read_text())["services"] == state["services"]  # the same PIDs

        other = cli(["up", "--runs-dir", str(runs), *port_args()])  # other ports while it runs: refused
        assert other.returncode == 2 and "`forgeweave down` first" in other.stderr, other.stderr
        trees, listened = process_trees(state), {port for _, port in sockets}
    _assert_all_gone(trees, listened, runs)


def _websocket_status(port: int, host: str) -> int:
    """The HTTP status of a WebSocket handshake to the dashboard's stream with this Host (and the same Origin, as a
    browser on that name sends)."""
    key = base64.b64encode(os.urandom(16)).decode()
    request = (f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamlit\r\n"
               f"Origin: http://{host}\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request.encode())
        return int(conn.recv(200).split(b" ", 2)[1])


def _check_auth(runs: Path, state: dict, creds: stack_auth.Credentials, deployment_id: str) -> None:
    """Acceptance: the stack's Prefect API and MLflow server refuse a caller without the credentials (401) and serve
    one with them; `up` said where they are; the file is the owner's only, and `up` again keeps it."""
    path = runs / ".stack" / "auth" / "credentials.env"
    lines = [line for line in state["up_stdout"].splitlines() if str(path) in line]
    assert len(lines) == 1 and lines[0].startswith(f"credentials: {path} "), state["up_stdout"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert creds.mlflow_password not in state["up_stdout"] and creds.prefect_auth_string not in state["up_stdout"]
    assert creds.mlflow_password not in (runs / ".stack" / "stack.json").read_text()

    # Prefect: reading and, above all, starting a run of a served deployment need the auth string
    api = state["env"]["PREFECT_API_URL"]
    user, password = creds.prefect_auth_string.split(":", 1)
    start_run = f"{api}/deployments/{deployment_id}/create_flow_run"
    for headers in ({}, stack_auth.basic_auth_header(user, "wrong-password")):
        assert http_status(f"{api}/deployments/{deployment_id}", headers) == 401
        assert http_status(start_run, headers, body={"parameters": {}}) == 401
        assert http_status(f"{api}/flow_runs/filter", headers, body={}) == 401
    good = stack_auth.prefect_header(creds)
    assert http_status(f"{api}/flow_runs/filter", good, body={}) == 200
    assert http_status(f"{api}/health") == 200  # health stays open (up's and compose's checks)

    # MLflow: its REST API and its UI's pages need the user; the default password of old MLflow versions is refused
    mlflow = state["env"]["MLFLOW_TRACKING_URI"]
    assert_mlflow_asks_for_its_user(mlflow, creds)
    assert http_status(f"{mlflow}/health") == 200

    # clients: `status --env` gives the person's client its credentials; the dashboard's MLflow reader gets in with
    # the read-only user's (which the stack's dashboard process has in its environment, never the admin's password)
    # and is refused without
    env = cli(["status", "--env", "--runs-dir", str(runs)]).stdout
    assert f"export MLFLOW_TRACKING_PASSWORD={creds.mlflow_password}" in env
    assert f"export PREFECT_API_AUTH_STRING={creds.prefect_auth_string}" in env
    dashboard_env = Path(f"/proc/{state['services']['dashboard']['pid']}/environ").read_bytes().split(b"\0")
    assert f"MLFLOW_TRACKING_PASSWORD={creds.role_password('viewer')}".encode() in dashboard_env
    assert not [v for v in dashboard_env if creds.mlflow_password.encode() in v]
    # the dashboard asks for a login (tests/dashboard/test_login.py): the stack's MLflow user and password, or the
    # token of the URL `up` prints (kept beside the credentials, 0600)
    token = (path.parent / "dashboard.token").read_text().strip()
    assert f"dashboard: {state['services']['dashboard']['url']}/?token={token}" in state["up_stdout"].splitlines()
    assert f"FORGEWEAVE_DASHBOARD_TOKEN={token}".encode() in dashboard_env
    login = f"FORGEWEAVE_DASHBOARD_LOGIN={creds.mlflow_username}:pbkdf2_sha256$".encode()  # a digest of the password
    assert [v for v in dashboard_env if v.startswith(login)]
    probe = f"from dashboard.mlflow_store import read_index; print(repr(read_index({mlflow!r}).error))"
    for extra, ok in ((creds.role_env("viewer"), True), ({}, False)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")} | extra
        out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert (out.stdout.strip() == "''") == ok, out.stdout

    # `up` again keeps the credentials; credentials deleted while the stack runs: refused, not half-applied
    before = path.read_text()
    again = cli(["up", "--runs-dir", str(runs), *_same_ports(state)])
    assert again.returncode == 0 and f"credentials: {path}" in again.stdout, again.stdout + again.stderr
    assert path.read_text() == before
    path.rename(path.with_name("moved"))
    try:
        refused = cli(["up", "--runs-dir", str(runs), *_same_ports(state)])
        assert refused.returncode == 2 and "is missing while the stack runs" in refused.stderr, refused.stderr
        assert not path.exists()
    finally:
        path.with_name("moved").rename(path)


def _same_ports(state: dict) -> list[str]:
    return [a for name, port in state["ports"].items() for a in (f"--{name.replace('_', '-')}-port", str(port))]


@pytest.fixture
def pg_runs():
    """A runs dir the `postgres` user can reach (pytest's tmp dirs are 0700: PostgreSQL does not run as root)."""
    root = Path(tempfile.mkdtemp(prefix="forgeweave-pg-"))
    root.chmod(0o755)
    yield root / "runs"
    shutil.rmtree(root, ignore_errors=True)


def test_up_postgres_backs_prefect_and_mlflow(pg_runs, monkeypatch):
    """Acceptance: a run tracked by the Postgres-backed MLflow server records params, metrics and registered
    checkpoints; its Prefect flow run is a row of the Prefect database in the same cluster; `down` stops all."""
    import psycopg2
    from mlflow.tracking import MlflowClient

    runs = pg_runs
    with running_stack(runs, "--db", "postgres") as state:
        assert set(state["services"]) == SERVICES | {"postgres"} and state["db"] == "postgres"
        pg = state["services"]["postgres"]
        if os.geteuid() == 0:  # PostgreSQL refuses root: the server runs as the package's `postgres` user
            assert Path(f"/proc/{pg['pid']}").stat().st_uid == pwd.getpwnam("postgres").pw_uid
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pg['pid']}/status").read_text().splitlines())
            gid = str(pwd.getpwnam("postgres").pw_gid)  # its own group, and none of root's (issue 46)
            assert set(status["Gid"].split()) == {gid} and status["Groups"].split() in ([], [gid]), status["Groups"]
        assert (runs / ".stack" / "postgres" / "data" / "PG_VERSION").is_file()
        assert cli(["status", "--runs-dir", str(runs)]).returncode == 0

        sets = ["steps=2", "eval.every=2", "eval.k=0", "checkpoint.every=2", "threads=1"]
        run = cli(["run", "--preset", "tiny", *[a for s in sets for a in ("--set", s)], "--name", "pg-run",
                   "--runs-dir", str(runs), "--quiet"], timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        assert "using the stack of this runs dir" in run.stdout
        summary = json.loads((runs / "pg-run" / "summary.json").read_text())

        assert f"(credentials: {runs / '.stack' / 'auth' / 'credentials.env'})" in run.stdout
        for key, value in stack_auth.read_credentials(runs / ".stack").mlflow_env().items():  # the server asks
            monkeypatch.setenv(key, value)
        client = MlflowClient(state["env"]["MLFLOW_TRACKING_URI"])
        mlrun = client.get_run(summary["mlflow_run_id"])
        assert mlrun.data.params["steps"] == "2" and mlrun.data.params["preset"] == "tiny"
        rewards = client.get_metric_history(mlrun.info.run_id, "reward/mean")
        assert sorted(m.step for m in rewards) == [1, 2]
        versions = client.search_model_versions("name='forgeweave-tiny'")
        mine = [v for v in versions if v.run_id == mlrun.info.run_id]
        assert mine and {v.tags["forgeweave.step"] for v in mine} == {"2"}

        password = (runs / ".stack" / "postgres.password").read_text().strip()
        port = state["ports"]["postgres"]

        def query(db: str, sql: str, arg: str) -> int:
            conn = psycopg2.connect(host="127.0.0.1", port=port, user="forgeweave", password=password, dbname=db)
            try:
                with conn.cursor() as cur:
                    cur.execute(sql, (arg,))
                    return cur.fetchone()[0]
            finally:
                conn.close()

        # the records are rows of the private cluster, not of some SQLite file
        assert query("mlflow", "SELECT count(*) FROM metrics WHERE run_uuid = %s", mlrun.info.run_id) >= 2
        assert query("prefect", "SELECT count(*) FROM flow_run WHERE id = %s", summary["prefect_flow_run_id"]) == 1
        assert not (runs / "mlflow.db").exists() and not (runs / ".stack" / "prefect.db").exists()
        trees, ports = process_trees(state), {port for _, port in stack_sockets(state)}
        assert port in ports
        _check_secrets_private(runs, state)
    _assert_all_gone(trees, ports, runs)


def _check_secrets_private(runs: Path, state: dict) -> None:
    """Issue 46: no process of the running stack (the services and all they started) has a secret in its command
    line, which any local user reads; the files holding them are 0600, the stack's state dir and logs the owner's."""
    state_dir = runs / ".stack"
    creds = stack_auth.read_credentials(state_dir)
    token_file = stack_auth.auth_dir(state_dir) / stack_auth.DASHBOARD_TOKEN
    found = [creds.prefect_auth_string.split(":", 1)[1], creds.mlflow_password, creds.role_password("viewer"),
             Path(state["ray_env"]["RAY_AUTH_TOKEN_PATH"]).read_text(), token_file.read_text()]  # fmt: skip
    secret_files = [stack_auth.credentials_path(state_dir), Path(state["ray_env"]["RAY_AUTH_TOKEN_PATH"]), token_file]
    if state["db"] == "postgres":
        found.append((state_dir / "postgres.password").read_text().strip())
        secret_files += [state_dir / "postgres.password", state_dir / "postgres.pgpass"]
    pids = [pid for tree in process_trees(state).values() for pid in tree]
    assert len(pids) > len(state["services"])  # the servers' workers, Ray's processes: all of them are read
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # ended since
        assert not [s for s in found if s in argv], f"pid {pid}: {argv.replace(chr(0), ' ')[:300]}"
    for path in secret_files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    as_pg_root = state["db"] == "postgres" and os.geteuid() == 0  # `postgres` passes through to its cluster
    assert stat.S_IMODE(state_dir.stat().st_mode) == (0o710 if as_pg_root else 0o700)
    assert stat.S_IMODE((state_dir / "logs").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (state_dir / "logs").iterdir()} == {0o600}
    ray_root = stack.ray_temp_root(stack.StackConfig(runs.resolve()))  # the head's 0777 folders lie behind it
    assert stat.S_IMODE(ray_root.stat().st_mode) == 0o700 and list((ray_root / "ray").glob("session_*"))


# ---------------------------------------------------------------- without a stack


def test_stop_process_leaves_a_recycled_pid_alone():
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        real = {"pid": proc.pid, "start": stack.start_time(proc.pid)}
        assert not stack.stop_process({**real, "start": real["start"] - 1}, signal.SIGTERM)  # another process
        assert proc.poll() is None
        assert stack.stop_process(real, signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_up_refuses_a_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        args = ["up", "--runs-dir", str(tmp_path / "runs"), *port_args(), "--mlflow-port", str(taken)]
        proc = cli(args)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"forgeweave: error: port {taken} (127.0.0.1) for mlflow is in use: choose another with --mlflow-port PORT"
    )
    assert not stack.state_path(tmp_path / "runs").exists()  # nothing started, nothing recorded


def test_a_health_answer_from_a_process_up_did_not_start_is_refused():
    """Issue 46: a local process that took a service's port in the moment between `up`'s port check and the server's
    bind would answer its health URL; `up` checks the listener is in the started service's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        other = subprocess.Popen(["sleep", "30"], start_new_session=True)  # "the mlflow `up` started": another group
        try:
            rec = {"health": f"http://127.0.0.1:{port}/health", "port": port, "pid": other.pid}
            with pytest.raises(UserError, match=rf"^mlflow: port {port} is answered by another process \(pid "):
                stack.squatter("mlflow", rec)
            stack.squatter("mlflow", {**rec, "pid": os.getpgid(0)})  # the listener in the service's group: fine
            stack.squatter("ray", {**rec, "health": "tcp"})  # not checked (Ray's daemons start sessions of their own)
        finally:
            other.kill()
            other.wait()


def test_ray_port_inside_rays_worker_range_is_refused(tmp_path):
    with pytest.raises(UserError, match="--ray-port 16379: Ray keeps"):
        stack.StackConfig(tmp_path, ports=stack.Ports(ray=16379))
    with pytest.raises(UserError, match="--db mysql: expected sqlite or postgres"):
        stack.StackConfig(tmp_path, db="mysql")


def test_run_takes_the_stack_urls_only_while_it_runs(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):  # recorded first, so teardown undoes what use_stack sets
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    assert stack.use_stack(str(runs)) == {}
    me = {"pid": os.getpid(), "start": stack.start_time(os.getpid())}  # a live process stands in for the servers
    env = {"PREFECT_API_URL": "http://127.0.0.1:1/api", "MLFLOW_TRACKING_URI": "http://127.0.0.1:2"}
    stack.write_state(runs, {"services": {"prefect": me, "mlflow": me}, "env": {**env, "FORGEWEAVE_RUNS_DIR": "x"}})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")  # the user's own setting wins
    assert stack.use_stack(str(runs)) == {"PREFECT_API_URL": "http://127.0.0.1:1/api"}
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://elsewhere:5000"
    monkeypatch.delenv("PREFECT_API_URL")
    dead = {"pid": me["pid"], "start": me["start"] + 1}
    stack.write_state(runs, {"services": {"prefect": dead, "mlflow": me}, "env": env})
    assert stack.use_stack(str(runs)) == {}  # a stack that is down is not used


def test_unreadable_state_is_a_one_line_error(tmp_path):
    path = stack.state_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    proc = cli(["status", "--runs-dir", str(tmp_path)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unreadable stack state" in proc.stderr


def test_down_without_a_stack(tmp_path):
    proc = cli(["down", "--runs-dir", str(tmp_path / "runs")])
    assert proc.returncode == 0 and proc.stdout.strip() == "nothing was running"
