"""The Checkpoints page's "Evaluate through Prefect" button against a real Prefect server on 127.0.0.1: without
the deployment it says how to register it; with it, a flow run with the checkpoint as parameter is scheduled."""

import asyncio

# Prefect reads its global settings from the environment once, when first imported: import it at collection, not
# under this module's PREFECT_API_URL (the tests after these would keep talking to a server that is gone)
import prefect  # noqa: F401
import pytest

from flows import stack_auth
from tests.dashboard.conftest import open_page, texts
from tests.servers import free_port
from tests.stack_helpers import server_alone


@pytest.fixture
def prefect_api(tmp_path, monkeypatch):
    """`forgeweave server` alone (it asks for its runs dir's credentials): yields (API URL, auth string); the auth
    string is in this process's environment, as `forgeweave dashboard` puts it in the app's for a server of its runs
    dir (flows.stack.dashboard_env)."""
    runs = tmp_path / "runs"
    with server_alone("server", runs, tmp_path / "server.log", {"PREFECT_HOME": str(tmp_path / "prefect-home")}) as url:
        auth = stack_auth.read_credentials(runs / ".stack").prefect_auth_string
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", auth)
        yield f"{url}/api", auth


def _register_evaluate_deployment(api: str, auth: str, runs_dir: str) -> None:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from flows.deployments import build_deployments

    evaluate = next(d for d in build_deployments(runs_dir) if d.name == "evaluate-checkpoint")
    with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
        evaluate.apply()


async def _read_flow_run(api: str, auth: str, flow_run_id: str):
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(api, auth_string=auth) as client:
        run = await client.read_flow_run(flow_run_id)
        deployment = await client.read_deployment(run.deployment_id)
        return run, deployment


def _click_evaluate(at):
    button = next(b for b in at.button if b.label.startswith("Evaluate step-000012"))
    button.click().run()
    assert not at.exception
    return at


def test_evaluate_button_schedules_the_deployment(tiny_run, prefect_api, monkeypatch):
    prefect_api, auth = prefect_api
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    at = open_page(tiny_run.parent, monkeypatch, "checkpoints")
    assert "No Prefect server is configured" not in texts(at)
    _click_evaluate(at)  # the deployment is not registered yet
    assert at.error[0].value.startswith(f"the Prefect server at {prefect_api} has no deployment")
    assert "forgeweave serve" in at.error[0].value

    _register_evaluate_deployment(prefect_api, auth, str(tiny_run.parent))
    _click_evaluate(at)
    assert not at.error, at.error[0].value
    message = at.success[0].value
    flow_run_id = message.split("(")[1].split(")")[0]
    run, deployment = asyncio.run(_read_flow_run(prefect_api, auth, flow_run_id))
    ckpt = str(tiny_run.resolve() / "checkpoints" / "step-000012")
    assert deployment.name == "evaluate-checkpoint" and run.parameters == {"checkpoint": ckpt}
    assert run.state.is_scheduled()  # nothing serves it here: the dashboard only asks
    assert f"`{run.name}`" in message


def test_evaluate_button_with_an_unreachable_server(tiny_run, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    monkeypatch.setenv("PREFECT_API_URL", url)
    at = _click_evaluate(open_page(tiny_run.parent, monkeypatch, "checkpoints"))
    assert at.error[0].value.startswith(f"could not reach the Prefect server at {url}")
