"""The dashboard's one action: ask a Prefect server to evaluate a checkpoint (it never evaluates or trains itself).

`start_evaluation` creates a flow run of the deployment "forgeweave-evaluate/evaluate-checkpoint" (registered
and served by `forgeweave serve`, see flows/deployments.py) through `prefect.deployments.run_deployment` with
`timeout=0`: it returns as soon as the run is scheduled; a worker of `forgeweave serve` executes it and writes
eval.json beside the checkpoint, which the Checkpoints page then shows. An explicit client for $PREFECT_API_URL
is used so the call never falls back to an ephemeral in-process server; it sends $PREFECT_API_AUTH_STRING when set (a
`forgeweave up` stack's API asks for it and gives it to the dashboard it starts). prefect is imported only here.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

DEPLOYMENT = "forgeweave-evaluate/evaluate-checkpoint"


class TriggerError(RuntimeError):
    """The flow run could not be created; the message says why and what to do, in one line."""


@dataclass(frozen=True)
class StartedRun:
    flow_run_id: str  # Prefect flow-run id
    flow_run_name: str  # Prefect's generated name, e.g. "sassy-otter"
    url: str  # the flow run in the Prefect UI


def prefect_api_url() -> str:
    """$PREFECT_API_URL, "" when no Prefect server is configured."""
    return os.environ.get("PREFECT_API_URL", "").strip()


def ui_url(api_url: str, flow_run_id: str) -> str:
    """http://host:4200/api -> http://host:4200/runs/flow-run/<id>."""
    base = api_url.rstrip("/").removesuffix("/api")
    return f"{base}/runs/flow-run/{flow_run_id}"


def start_evaluation(api_url: str, checkpoint: str) -> StartedRun:
    """Schedule an evaluation of the checkpoint directory `checkpoint` on the Prefect server at `api_url`."""
    try:
        flow_run = asyncio.run(_create_run(api_url, checkpoint))
    except Exception as e:  # noqa: BLE001 - turned into one line for the page
        raise TriggerError(_explain(e, api_url)) from e
    return StartedRun(str(flow_run.id), flow_run.name, ui_url(api_url, str(flow_run.id)))


async def _create_run(api_url: str, checkpoint: str):
    from prefect.client.orchestration import PrefectClient
    from prefect.deployments import run_deployment

    # a server with API authentication (the `forgeweave up` stack's) asks for $PREFECT_API_AUTH_STRING
    auth = os.environ.get("PREFECT_API_AUTH_STRING") or None
    async with PrefectClient(api_url, api_key=os.environ.get("PREFECT_API_KEY") or None, auth_string=auth) as client:
        return await run_deployment(
            DEPLOYMENT, client=client, parameters={"checkpoint": checkpoint}, timeout=0, as_subflow=False
        )


def _explain(e: Exception, api_url: str) -> str:
    from prefect.exceptions import ObjectNotFound

    if isinstance(e, ObjectNotFound):
        return (
            f"the Prefect server at {api_url} has no deployment '{DEPLOYMENT}': "
            "register and serve it with `forgeweave serve`"
        )
    first = (str(e).splitlines() or [""])[0]
    return f"could not reach the Prefect server at {api_url} ({type(e).__name__}: {first}); is `forgeweave server` running?"
