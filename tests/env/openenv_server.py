"""The OpenEnv server the tests start (one process, several environments): forge/tasks/openenv_sum.py's MCP sum
environment at `/` (64 sessions), its typed-action twin at `/guess`, the MCP one capped at 2 sessions at `/capped`,
at `/slow` an MCP environment whose `wait` tool sleeps (tool timeouts), and at `/text` the sum task with a text action
(`message`: env.openenv.text_action) and an instruction as its reset observation, and at `/raw` a session speaking the
WebSocket protocol by hand whose answers carry rewards openenv-core's own classes never send (a row's `reset_reward`
and `step_reward`, raw JSON spliced into the answer: `1e309`, a string...; or `reset_answer`, the whole answer). Served
with
`python -m uvicorn tests.env.openenv_server:app`; built only from openenv-core's own classes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
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


raw = FastAPI()
RAW_RESET_REWARDS = ["0", "1e309", "0", '"high"']  # without a row's reset_reward: every 2nd reset's reward is bad
_raw_resets = 0
RAW_TOOL = {"name": "check", "description": "Check a guess.",
            "input_schema": {"type": "object", "properties": {"guess": {"type": "integer"}}}}  # fmt: skip


def _raw_answer(observation: dict, reward: str, done: bool = False) -> str:
    """An observation answer as text, `reward` spliced in as it is (JSON that json.dumps would never write)."""
    return (f'{{"type": "observation", "data": {{"observation": {json.dumps(observation)}, "reward": {reward}, '
            f'"done": {json.dumps(done)}}}}}')  # fmt: skip


@raw.get("/health")
def raw_health() -> dict:
    return {"status": "healthy"}


@raw.websocket("/ws")
async def raw_session(ws: WebSocket) -> None:
    """One session: reset keeps the row's `reset_reward` / `step_reward` (raw JSON; defaults: RAW_RESET_REWARDS in
    turn, by the server's count of resets, and null); a check answers
    "right" with the step reward and ends the episode; state and list_tools as openenv-core answers them."""
    global _raw_resets
    await ws.accept()
    row: dict = {}
    try:
        while True:
            message = json.loads(await ws.receive_text())
            kind, data = message.get("type"), message.get("data") or {}
            if kind == "close":
                break
            if kind == "state":
                await ws.send_text('{"type": "state", "data": {}}')
            elif kind == "reset":
                row, _raw_resets = data, _raw_resets + 1
                default = RAW_RESET_REWARDS[_raw_resets % len(RAW_RESET_REWARDS)]
                await ws.send_text(row.get("reset_answer") or _raw_answer({}, row.get("reset_reward", default)))
            elif data.get("type") == "list_tools":
                await ws.send_text(_raw_answer({"tools": [RAW_TOOL]}, "null"))
            else:
                result = {"content": [{"type": "text", "text": "right"}]}
                observation = {"tool_name": data.get("tool_name"), "result": result, "error": None}
                await ws.send_text(_raw_answer(observation, row.get("step_reward", "null"), done=True))
    except WebSocketDisconnect:
        return
    await ws.close()


app.mount("/raw", raw)
