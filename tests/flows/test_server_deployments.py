"""Against a real Prefect server on 127.0.0.1: `forgeweave serve` registers the deployments, and a flow run
created through the API (what the UI's "Run" button does) trains a tiny model to completion."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process we started (and its process group) by PID: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "forgeweave"), "server", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/health", timeout=90)
        yield f"http://127.0.0.1:{port}/api", env
    finally:
        _stop(proc)
        log.close()


async def _trigger_and_wait(api_url: str, params: dict, timeout: float) -> object:
    # an explicit client: this test process may already hold settings for the embedded server of other tests
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(api_url) as client:
        deadline = time.time() + 180
        while True:
            try:
                deployment = await client.read_deployment_by_name("forgeweave-grpo/pipeline")
                break
            except Exception:
                if time.time() > deadline:
                    raise
                await asyncio.sleep(1)
        run = await client.create_flow_run_from_deployment(deployment.id, parameters=params)
        deadline = time.time() + timeout
        while time.time() < deadline:
            run = await client.read_flow_run(run.id)
            if run.state and run.state.is_final():
                return run
            await asyncio.sleep(1)
    raise TimeoutError("flow run did not finish")


def test_ui_trigger_runs_the_pipeline(prefect_server, tmp_path):
    api_url, env = prefect_server
    runs = tmp_path / "runs"
    env = {**env, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO)}
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [str(BIN / "forgeweave"), "serve", "--runs-dir", str(runs)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        params = {"preset": "tiny", "name": "from-ui", "overrides": ["steps=3", "eval.k=0", "eval.every=3"]}
        try:
            run = asyncio.run(_trigger_and_wait(api_url, params, timeout=300))
        except Exception as e:
            raise AssertionError(f"{e!r}; serve log: {(tmp_path / 'serve.log').read_text()[-3000:]}") from e
        assert run.state.is_completed(), (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        _stop(serve)
        log.close()
    summary = json.loads((runs / "from-ui" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["prefect_flow_run_id"] == str(run.id)
    assert (runs / "from-ui" / "checkpoints" / "step-000003" / "model.safetensors").is_file()
