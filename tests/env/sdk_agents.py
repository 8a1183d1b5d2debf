"""Agents written with the OpenAI Agents SDK (`openai-agents`), unchanged but for the client they are given: an
`AsyncOpenAI` on the episode's base URL (tests/env/test_agent_sdk.py)."""

from __future__ import annotations

import re

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def model(base_url: str) -> OpenAIChatCompletionsModel:
    return OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key="none"))


async def adder(base_url: str, row: dict) -> float:
    """A tool-using agent: 1 when its final output is the row's answer."""
    agent = Agent(name="adder", instructions="Use add, then answer with the number.", tools=[add],
                  model=model(base_url))  # fmt: skip
    result = await Runner.run(agent, row["model_input"], max_turns=4)
    return float(str(result.final_output).strip() == row["answer"])


async def answerer(base_url: str, row: dict) -> float:
    """A one-request agent for the tiny model: 1 for the answer as the final output's last number, 0.25 for an output
    with a digit, else 0 (what the tiny model can learn in a few steps is mostly the format)."""
    agent = Agent(name="answerer", model=model(base_url), model_settings=ModelSettings(max_tokens=3))
    result = await Runner.run(agent, row["model_input"], max_turns=1)
    numbers = re.findall(r"\d+", str(result.final_output))
    return 1.0 if numbers and numbers[-1] == str(row["answer"]) else 0.25 if numbers else 0.0
