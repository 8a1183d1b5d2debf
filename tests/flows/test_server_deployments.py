"""Against a real Prefect server on 127.0.0.1: `forgeweave serve` registers the deployments, and a flow run
created through the API (what the UI's "Run" button does) trains a tiny model to completion."""

import asyncio
import json
import subprocess
import time

from tests.servers import BIN, REPO, stop


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
        stop(serve)
        log.close()
    summary = json.loads((runs / "from-ui" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["prefect_flow_run_id"] == str(run.id)
    assert (runs / "from-ui" / "checkpoints" / "step-000003" / "model.safetensors").is_file()
