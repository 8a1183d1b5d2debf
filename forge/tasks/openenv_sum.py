"""The `tiny-multiturn` sum task as an OpenEnv environment server (openenv-core's own classes), for the OpenEnv path
of forge/env/openenv.py, its tests and docs/environments.md.

`SumCheckEnv` is an `MCPEnvironment` with one MCP tool, `check(guess)`, answering "right" or "wrong". `reset`
takes the data row's columns (the WebSocket reset message's data; here `answer`). A right guess sets the
observation's reward to 1.0 and ends the episode (done); a wrong one gives reward 0.0 and the episode goes on.
`SumGuessEnv` is the same task with a typed action of its own instead of MCP (`GuessAction(guess)`, answered by a
`GuessObservation` whose `feedback` is "right" or "wrong"). `app` and `guess_app` are the FastAPI apps openenv-core
builds for them (HTTP, MCP and the `/ws` sessions), each with at most `OPENENV_SUM_MAX_SESSIONS` (default 64)
WebSocket sessions at once:

    python -m uvicorn forge.tasks.openenv_sum:app --host 127.0.0.1 --port 8000

forge never imports this module itself (it needs openenv-core, fastapi and fastmcp, the `openenv` extra): the
server runs in a process of its own (`env.openenv.app=forge.tasks.openenv_sum:app`).
"""

from __future__ import annotations

import os
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

MAX_SESSIONS = int(os.environ.get("OPENENV_SUM_MAX_SESSIONS", "64"))


class SumCheckEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance and nothing shared

    def __init__(self):
        mcp = FastMCP("sum-check")
        self.answer, self.solved, self.checks = "", False, 0
        self._state = State()

        @mcp.tool
        def check(guess: int) -> str:
            """Check whether a guess is the sum.

            Args:
                guess: the proposed sum
            """
            self.checks += 1
            self.solved = str(guess).strip() == self.answer
            return "right" if self.solved else "wrong"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> Observation:
        self.answer, self.solved, self.checks = str(row.get("answer", "")).strip(), False, 0
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=None)

    async def step_async(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        return self._scored(action, observation)

    def step(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    def _scored(self, action, observation: Observation) -> Observation:
        """A check's reward (1 right, 0 wrong) and done (right) on its observation."""
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "check" and observation.error is None:
            observation.reward, observation.done = float(self.solved), self.solved
        return observation

    def _step_impl(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unsupported action {type(action).__name__}: call the check tool"})

    @property
    def state(self) -> State:
        return self._state


class GuessAction(Action):
    """Guess the sum."""

    guess: int = Field(description="the proposed sum")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="'right' or 'wrong' after a guess; empty after reset")


class SumGuessEnv(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.answer, self._state = "", State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **row: Any) -> GuessObservation:
        self.answer, self._state = str(row.get("answer", "")).strip(), State(episode_id=episode_id, step_count=0)
        return GuessObservation()

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        right = str(action.guess) == self.answer
        return GuessObservation(feedback="right" if right else "wrong", reward=float(right), done=right)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(SumCheckEnv, CallToolAction, CallToolObservation, max_concurrent_envs=MAX_SESSIONS)
guess_app = create_fastapi_app(SumGuessEnv, GuessAction, GuessObservation, max_concurrent_envs=MAX_SESSIONS)
