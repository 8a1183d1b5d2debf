"""The OpenEnv server the tests start (one process, several environments): forge/tasks/openenv_sum.py's MCP sum
environment at `/` (64 sessions), its typed-action twin at `/guess`, the MCP one capped at 2 sessions at `/capped`,
and at `/slow` an MCP environment whose `wait` tool sleeps (tool timeouts). Served with
`python -m uvicorn tests.env.openenv_server:app`; built only from openenv-core's own classes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import (
    CallToolAction,
    CallToolObservation,
    MCPEnvironment,
    Observation,
    State,
    create_fastapi_app,
)

from forge.tasks.openenv_sum import SumCheckEnv, app, guess_app


class SlowEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("slow")

        @mcp.tool
        async def wait(seconds: float) -> str:
            """Sleep, then say how long.

            Args:
                seconds: how long to sleep
            """
            await asyncio.sleep(seconds)
            return f"slept {seconds:g}"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Observation:
        return Observation()

    def _step_impl(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation()

    @property
    def state(self) -> State:
        return State()


app.mount("/guess", guess_app)
app.mount("/capped", create_fastapi_app(SumCheckEnv, CallToolAction, CallToolObservation, max_concurrent_envs=2))
app.mount("/slow", create_fastapi_app(SlowEnv, CallToolAction, CallToolObservation, max_concurrent_envs=8))
