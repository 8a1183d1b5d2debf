"""Against a real Prefect server on 127.0.0.1: `forgeweave serve` registers the deployments, and a flow run
created through the API (what the UI's "Run" button does) trains a tiny model to completion, in-process and in
Ray mode."""

import asyncio
import json
import subprocess
import time
from pathlib import Path

from flows import stack_auth
from tests.servers import BIN, REPO, stop


def _client(api_url: str, runs: Path):
    """An explicit client (this test process may already hold settings for the embedded server of other tests) with
    the auth string of the runs dir's server."""
    from prefect.client.orchestration import PrefectClient

    return PrefectClient(api_url, auth_string=stack_auth.read_credentials(runs / ".stack").prefect_auth_string)


async def _trigger_and_wait(api_url: str, params: dict, timeout: float, runs: Path) -> object:
    async with _client(api_url, runs) as client:
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
    ray_overrides = ["steps=2", "eval.k=0", "eval.every=2", "orchestration.execution=ray"]
    try:
        params = {"preset": "tiny", "name": "from-ui", "overrides": ["steps=3", "eval.k=0", "eval.every=3"]}
        run = _run(api_url, params, tmp_path)
        ray_run = _run(api_url, {"preset": "tiny", "name": "from-ui-ray", "overrides": ray_overrides}, tmp_path)
        ray_tasks = asyncio.run(_task_run_names(api_url, str(ray_run.id), runs))
    finally:
        stop(serve)
        log.close()
    summary = json.loads((runs / "from-ui" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["prefect_flow_run_id"] == str(run.id)
    assert summary["execution"] == "embedded"
    assert (runs / "from-ui" / "checkpoints" / "step-000003" / "model.safetensors").is_file()
    # the same deployment in Ray mode: every stage in an actor (a private Ray instance), task runs in the API
    summary = json.loads((runs / "from-ui-ray" / "summary.json").read_text())
    assert summary["execution"] == "ray" and summary["steps"] == 2 and summary["prefect_flow_run_id"] == str(ray_run.id)
    workers = json.loads((runs / "from-ui-ray" / "workers.json").read_text())
    assert {"rollout", "reward", "update"} <= set(workers) and all(w[0]["node_id"] for w in workers.values())
    expected = {"prepare-000000", "evaluate-000002", "checkpoint-000002"}
    expected |= {f"{s}-{i:06d}" for s in ("rollout", "reward", "update") for i in (1, 2)}
    assert expected <= ray_tasks, expected - ray_tasks


def _run(api_url: str, params: dict, tmp_path):
    try:
        run = asyncio.run(_trigger_and_wait(api_url, params, 300, tmp_path / "runs"))
    except Exception as e:
        raise AssertionError(f"{e!r}; serve log: {(tmp_path / 'serve.log').read_text()[-3000:]}") from e
    assert run.state.is_completed(), (tmp_path / "serve.log").read_text()[-3000:]
    return run


async def _task_run_names(api_url: str, flow_run_id: str, runs: Path) -> set[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with _client(api_url, runs) as client:
        for _ in range(60):  # task-run records arrive as events: give the server a moment
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            names = {r.name for r in runs if r.state is not None and r.state.is_completed()}
            if len(names) >= 9:
                return names
            await asyncio.sleep(1)
    return names
