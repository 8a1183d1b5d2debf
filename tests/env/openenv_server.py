"""The OpenEnv server the tests start (one process, several environments): forge/tasks/openenv_sum.py's MCP sum
environment at `/` (64 sessions), its typed-action twin at `/guess`, the MCP one capped at 2 sessions at `/capped`,
at `/slow` an MCP environment whose `wait` tool sleeps (tool timeouts), and at `/text` the sum task with a text action
(`message`: env.openenv.text_action) and an instruction as its reset observation. Served with
`python -m uvicorn tests.env.openenv_server:app`; built only from openenv-core's own classes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import (
    Action,
    CallToolAction,
    CallToolObservation,
    Environment,
    MCPEnvironment,
    Observation,
    State,
    create_fastapi_app,
)
from pydantic import Field

from forge.tasks.openenv_sum import SumCheckEnv, app, guess_app

TEXT_INSTRUCTION = "Reply with the sum alone."  # TextGuessEnv's reset observation


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


class MessageAction(Action):
    """Say something to the environment."""

    message: str = Field(description="what the policy says")


class TextObservation(Observation):
    text: str = Field(default="", description="the instruction after reset, then 'right' or 'wrong, try again'")


class TextGuessEnv(Environment[MessageAction, TextObservation, State]):
    """The sum task with a text action (as OpenEnv's echo_env takes a `message`): reset's observation is the
    instruction, each message is a guess; a right one ends the episode with reward 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.answer, self._state = "", State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> TextObservation:
        self.answer, self._state = str(row.get("answer", "")).strip(), State(episode_id=episode_id, step_count=0)
        return TextObservation(text=TEXT_INSTRUCTION)

    def step(self, action: MessageAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        right = action.message.strip() == self.answer
        return TextObservation(text="right" if right else "wrong, try again", reward=float(right), done=right)

    @property
    def state(self) -> State:
        return self._state


app.mount("/text", create_fastapi_app(TextGuessEnv, MessageAction, TextObservation, max_concurrent_envs=8))
