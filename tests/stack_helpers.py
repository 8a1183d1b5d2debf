"""Start and stop `forgeweave up` stacks in tests: every port a free one (never a default), `down` in teardown
even when a test failed, and what the stack's processes listen on."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from flows.reaper import descendants
from tests.servers import REPO, free_port, listening, start, stop, wait_http

UP_TIMEOUT_S = 150  # what the test allows `up` on 2 cores shared with other jobs; docs/stack.md has the measured time


def cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def port_args() -> list[str]:
    """--prefect-port ... with a free port each (all above Ray's worker port range 10002-19999)."""
    names = ("prefect", "mlflow", "dashboard", "ray", "postgres")
    return [a for n in names for a in (f"--{n}-port", str(free_port()))]


@contextlib.contextmanager
def running_stack(runs: Path, *extra: str) -> Iterator[dict]:
    """`forgeweave up` on free ports for the block; yields the state file's content; `down` afterwards."""
    try:
        up = cli(["up", "--runs-dir", str(runs), *port_args(), "--timeout", str(UP_TIMEOUT_S), *extra], timeout=400)
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((runs / ".stack" / "stack.json").read_text())
        state["up_stdout"] = up.stdout
        yield state
    finally:
        down = cli(["down", "--runs-dir", str(runs)], timeout=200)
        if down.returncode != 0:  # stop by PID from here rather than leave servers behind
            from flows.stack import down as stop_all

            stop_all(runs)
        assert down.returncode == 0, down.stdout + down.stderr


def process_trees(state: dict) -> dict[str, dict[int, int]]:
    """service -> pid -> start time of its recorded process and everything below it, as of now."""
    out = {}
    for name, rec in state["services"].items():
        out[name] = {rec["pid"]: rec["start"], **descendants(rec["pid"])}
    return out


def stack_sockets(state: dict) -> set[tuple[str, int]]:
    return listening([pid for tree in process_trees(state).values() for pid in tree])


@contextlib.contextmanager
def server_alone(command: str, runs: Path, log: Path, env: dict | None = None) -> Iterator[str]:
    """`forgeweave server|mlflow --runs-dir RUNS` on a free port, in its own session, until the block ends; yields its
    base URL once its health check (open without credentials) answers. Its output goes to `log`."""
    port = free_port()
    health = f"http://127.0.0.1:{port}" + ("/api/health" if command == "server" else "/health")
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = start([sys.executable, "-m", "flows.cli", command, "--runs-dir", str(runs), "--port", str(port)], env, log)
    try:
        wait_http(health, timeout=120, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def http_status(url: str, headers: dict | None = None, body: dict | None = None) -> int:
    """The HTTP status of a GET (or, with a body, a POST) to `url`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def assert_mlflow_asks_for_its_user(url: str, creds) -> None:
    """An MLflow server at `url` refuses its REST API and UI pages without its user, with the default password of old
    MLflow versions and with a wrong one; `creds` (flows.stack_auth.Credentials) gets in."""
    from flows import stack_auth

    search = f"{url}/api/2.0/mlflow/experiments/search?max_results=5"
    for headers in ({}, stack_auth.basic_auth_header("admin", "password1234"),
                    stack_auth.basic_auth_header(creds.mlflow_username, "wrong-password")):  # fmt: skip
        assert http_status(search, headers) == 401
        assert http_status(f"{url}/api/2.0/mlflow/experiments/create", headers, body={"name": "intruder"}) == 401
        assert http_status(f"{url}/", headers) == 401
    good = stack_auth.basic_auth_header(creds.mlflow_username, creds.mlflow_password)
    assert http_status(search, good) == 200 and http_status(f"{url}/", good) == 200
