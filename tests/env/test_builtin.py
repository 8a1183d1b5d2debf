"""The built-in `python` tool (forge/env/builtin.py): configured by env.builtin_tools, its schema, and in an episode
a hit (the program's output is the answer), a raise and a timeout (error answers, counted; the episode goes on)."""

from __future__ import annotations

import json

import pytest

from forge.compose import environment
from forge.config import ConfigError, EnvConfig, RunConfig, apply_overrides
from forge.env.chat import ChatFormat
from forge.env.episode import run_episodes
from forge.rollout.base import SamplingParams
from tests.env.test_episode import scripted


def python_call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def test_env_builtin_tools_python_is_a_tool_with_a_code_argument(tok):
    cfg = RunConfig()
    cfg.env.builtin_tools = ["python"]
    assert cfg.env.enabled and cfg.validate()
    _, functions, _ = environment(cfg, tok)
    (tool,) = functions
    params = tool.schema["function"]["parameters"]
    assert tool.name == "python" and params["properties"]["code"]["type"] == "string" and params["required"] == ["code"]
    cfg.env.builtin_tools = ["bash"]
    with pytest.raises(ConfigError, match="config key 'env.builtin_tools' has \\['bash'\\]"):
        cfg.validate()
    with pytest.raises(ConfigError, match="env.builtin_tools.* must be one of 'python'"):
        apply_overrides(RunConfig(), ["env.builtin_tools=[bash]"])


def test_the_python_tool_answers_with_the_output_and_turns_a_raise_or_a_timeout_into_an_error(tok):
    cfg = RunConfig()
    cfg.env.builtin_tools = ["python"]
    cfg.reward.code_exec.timeout_s, cfg.reward.code_exec.test_timeout_s = 2.0, 0.5
    _, functions, _ = environment(cfg, tok)
    turns = [python_call("print(6 * 7)"), python_call("print('a'); 1 / 0"), python_call("while True: pass"), "42"]
    rows = [{"prompt": "6*7=", "model_input": "6*7=", "answer": "42"}]
    ro = run_episodes(scripted(tok, turns), tok, rows, SamplingParams(max_new_tokens=64, n=1, seed=0),
                      EnvConfig(max_turns=4, max_tokens=2000), ChatFormat(tok, False), None, functions, version=0)  # fmt: skip
    answers = [(t["content"], t["error"]) for t in ro.episodes.transcripts[0] if t["role"] == "tool"]
    assert answers == [
        ("42\n", False),
        ("a\nError: ZeroDivisionError: division by zero", True),
        ("Error: the program ran past its 0.5 s limit", True),
    ]
    assert ro.episodes.turns == [4] and ro.episodes.tool_errors == [2] and ro.finish_reasons == ["stop"]
