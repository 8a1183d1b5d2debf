"""Issue 46 (medium): a tool that never returns, a turn with thousands of calls and a turn of 1,000 nested brackets
cannot starve, stall or end a run. Each
call past env.tool_timeout_s is answered with an error; once forge.env.tools.MAX_STUCK_TOOLS such calls still run,
an episode that calls a tool fails (one line) instead of waiting; a turn's calls past env.max_tool_calls_per_turn
are not run, get one error answer, and are counted; a call nested too deeply for json is one error answer."""

from __future__ import annotations

import threading
import time

import pytest

from forge.config import EnvConfig
from forge.env import tools as forge_tools
from forge.env.chat import ChatFormat
from forge.env.episode import run_episodes
from forge.env.tools import tool_of
from forge.rollout.base import SamplingParams
from tests.env.test_episode import CALL, CounterEnv, scripted

RELEASE = threading.Event()  # the hung tool returns when the test sets it (so no thread outlives the test)


def hang() -> str:
    """Never returns (until the test lets it)."""
    RELEASE.wait()
    return "late"


def _play(tok, turns, cfg, n=1):
    rows = [{"prompt": "3?", "model_input": "3?", "answer": "3"}]
    params = SamplingParams(max_new_tokens=64, n=n, seed=0)
    fmt = ChatFormat(tok, use_template=False)
    return run_episodes(scripted(tok, turns), tok, rows, params, cfg, fmt, CounterEnv, [tool_of(hang)], version=0)


@pytest.fixture
def release_hung_tools():
    RELEASE.clear()
    yield
    RELEASE.set()
    for t in list(forge_tools._stuck):
        t.join(5)
    assert not any(t.is_alive() for t in forge_tools._stuck)


@pytest.mark.usefixtures("release_hung_tools")
def test_hung_tools_time_out_then_fail_episodes_instead_of_hanging_the_run(tok, monkeypatch):
    monkeypatch.setattr(forge_tools, "MAX_STUCK_TOOLS", 2)
    call = '<tool_call>{"name": "hang"}</tool_call>'
    cfg = EnvConfig(max_turns=3, max_tokens=2000, tool_timeout_s=0.2)
    t0 = time.perf_counter()
    first = _play(tok, [call, call, "3"], cfg)  # two calls, two timeouts: both threads run on
    answers = [s["content"] for s in first.episodes.transcripts[0] if s["role"] == "tool"]
    assert answers == ["Error: tool 'hang' timed out after 0.2 s"] * 2 and first.episodes.tool_errors == [2]
    assert first.finish_reasons == ["stop"] and first.episodes.failures == [""]
    # the cap is reached: the next episodes' calls are refused at once, each fails its episode in one line
    second = _play(tok, [call, "3"], cfg, n=3)
    assert second.finish_reasons == ["error"] * 3 and int(second.loss_mask.sum()) == 0
    why = second.episodes.failures[0]
    assert "\n" not in why and why.startswith("tool 'hang' not called: 2 earlier tool calls still run past")
    assert time.perf_counter() - t0 < 5  # 2 x 0.2 s of timeouts, no wait for the stuck threads
    # the hung calls return: their places are free again, and a tool that works is answered
    RELEASE.set()
    for t in list(forge_tools._stuck):
        t.join(5)
    third = _play(tok, [CALL, "3"], cfg)
    assert third.finish_reasons == ["stop"] and third.episodes.tool_errors == [0]


def test_ten_thousand_calls_in_one_turn_run_the_first_ones_and_count_the_rest(tok):
    many = CALL * 10_000  # add(3) ten thousand times
    cfg = EnvConfig(max_turns=3, max_tokens=2_000_000, max_tool_calls_per_turn=4)
    t0 = time.perf_counter()
    ro = _play(tok, [many, "3"], cfg)
    tools = [s for s in ro.episodes.transcripts[0] if s["role"] == "tool"]
    assert [s["content"] for s in tools[:4]] == ["3", "6", "9", "12"]  # the first 4 ran, in order
    assert tools[4] == {
        "role": "tool",
        "name": None,
        "content": "Error: 10000 tool calls in one turn; only the first 4 were run (env.max_tool_calls_per_turn)",
        "error": True,
    }
    assert len(tools) == 5 and ro.episodes.environments[0].total == 12
    assert ro.episodes.tool_calls == [10_000] and ro.episodes.tool_errors == [9_996]
    assert ro.finish_reasons == ["stop"] and time.perf_counter() - t0 < 30


def test_a_turn_of_a_thousand_nested_brackets_is_one_counted_error_answer_and_the_episode_goes_on(tok):
    """`[` * 1,000 in a tool call raised RecursionError in json (and ended the run): now an error answer."""
    cfg = EnvConfig(max_turns=3, max_tokens=20_000)
    ro = _play(tok, ["<tool_call>" + "[" * 1000 + "</tool_call>", CALL, "3"], cfg)
    tools = [s["content"] for s in ro.episodes.transcripts[0] if s["role"] == "tool"]
    assert tools == ["Error: malformed tool call (JSON nested too deeply)", "3"]  # the next call is answered
    assert ro.episodes.tool_calls == [2] and ro.episodes.tool_errors == [1] and ro.episodes.turns == [3]
    assert ro.finish_reasons == ["stop"] and ro.episodes.failures == [""]


def test_a_tool_that_raises_system_exit_is_an_error_answer_not_the_runs_end():
    def quit_() -> str:
        """Exits."""
        raise SystemExit(3)

    answer, failed = forge_tools.call_tool({"quit_": tool_of(quit_)}, "quit_", {}, 1.0)
    assert failed and answer == "Error: tool 'quit_' raised RuntimeError: SystemExit: 3"
