"""Agents written with the OpenAI Agents SDK (`openai-agents`), unchanged but for the client they are given: an
`AsyncOpenAI` on the episode's base URL (tests/env/test_agent_sdk.py), built as docs/agents.md advises for an agent
that plays many episodes: on one TLS context built once, and closed when the episode ends."""

from __future__ import annotations

import re
import ssl

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers

# Every client would otherwise build its own and load the CA bundle into it (~25 ms of CPU, measured: 3/4 of what an
# episode of `answerer` costs its process, 2-3 s of a 64-episode step on 2 cores); one context serves them all.
TLS = ssl.create_default_context()


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="none", http_client=DefaultAsyncHttpxClient(verify=TLS))


def model(openai_client: AsyncOpenAI) -> OpenAIChatCompletionsModel:
    return OpenAIChatCompletionsModel(model="policy", openai_client=openai_client)


async def adder(base_url: str, row: dict) -> float:
    """A tool-using agent: 1 when its final output is the row's answer."""
    async with client(base_url) as openai_client:  # closed in the episode's event loop, not after it
        agent = Agent(name="adder", instructions="Use add, then answer with the number.", tools=[add],
                      model=model(openai_client))  # fmt: skip
        result = await Runner.run(agent, row["model_input"], max_turns=4)
    return float(str(result.final_output).strip() == row["answer"])


async def answerer(base_url: str, row: dict) -> float:
    """A one-request agent for the tiny model: 1 for the answer as the final output's last number, 0.25 for an output
    with a digit, else 0 (what the tiny model can learn in a few steps is mostly the format)."""
    async with client(base_url) as openai_client:
        agent = Agent(name="answerer", model=model(openai_client), model_settings=ModelSettings(max_tokens=3))
        result = await Runner.run(agent, row["model_input"], max_turns=1)
    numbers = re.findall(r"\d+", str(result.final_output))
    return 1.0 if numbers and numbers[-1] == str(row["answer"]) else 0.25 if numbers else 0.0
