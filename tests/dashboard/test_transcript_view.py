"""A multi-turn run on the run detail page: its episode curves (env/*) point for point from metrics.jsonl, and a
sample as a chat transcript: the prompt, the policy's turns with their tool calls set apart as JSON, each tool's
answer as its own message under the tool's name (an error answer in red), and the episode's figures. The run is a
real tiny-multiturn run; the episodes that call tools are played by forge's episode loop (tests.episode_samples).
A single-turn run's samples stay the plain table they were."""

import json
import shutil

import pytest

from dashboard.views.run_detail import ENV_CURVES
from tests.dashboard.conftest import MT_RUN, charts, open_page, read_metrics
from tests.episode_samples import OBSERVATION, PROMPT, UNKNOWN_TOOL, write_tool_episodes


def _samples_table(at):
    return next(d.value for d in at.dataframe if "completion" in d.value.columns)


def _episode_box(at):
    return next(s for s in at.selectbox if s.label == "episode")


def _metric(at, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.fixture
def tool_run(multiturn_run, tmp_path):
    """A copy of the multi-turn run whose samples.jsonl gains a step 3 of two tool-calling episodes (rows 16, 17)."""
    run = tmp_path / "runs" / MT_RUN
    shutil.copytree(multiturn_run, run)
    write_tool_episodes(run, step=3)
    return run


def test_episode_curves_chart_the_env_metrics(multiturn_run, monkeypatch):
    at = open_page(multiturn_run.parent, monkeypatch, "run_detail")
    shown = charts(at)
    assert "Episodes (multi-turn)" in [h.value for h in at.subheader]
    rows = [r for r in read_metrics(multiturn_run) if "env/turns" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "env/cut_frac" in [c for _, cols, _ in ENV_CURVES for c in cols]  # turns cut by max_new_tokens (issue 44)
    for title, columns, _ in ENV_CURVES:
        frame = shown[title][0]
        for col in columns:
            part, logged = frame[frame["metric"] == col], {r["step"]: r[col] for r in rows}
            assert dict(zip(part["step"], part["value"], strict=True)) == pytest.approx(logged)


def test_a_tool_episode_is_shown_as_a_chat_transcript(tool_run, monkeypatch):
    at = open_page(tool_run.parent, monkeypatch, "run_detail")
    table = _samples_table(at)  # figures as columns; the transcript itself is not a table cell
    assert "transcript" not in table.columns and len(table) == 18
    figures = table[["turns", "tool calls", "tool errors", "truncated"]].astype(object).values.tolist()
    assert figures[:16] == [[1, 0, 0, False]] * 16 and figures[16:] == [[3, 2, 1, False]] * 2

    box = _episode_box(at)
    assert box.options[16] == "#16 · step 3 · reward 1.000 · 3 turns · 2 tool calls"
    box.set_value(16).run()
    assert not at.exception
    assert [_metric(at, k) for k in ("turns", "tool calls", "tool errors", "truncated")] == ["3", "2", "1", "no"]

    chat = at.chat_message
    assert [m.name for m in chat] == ["user", "environment", "assistant", "tool", "assistant", "tool", "assistant"]
    assert chat[0].text[0].value == PROMPT
    seen = chat[1]  # reset's first observation (issue 44): after the prompt, marked as the environment's, untrained
    assert seen.avatar == ":material/public:" and [t.value for t in seen.text] == [OBSERVATION]
    assert "not trained" in seen.caption[0].value
    chat = [chat[0], *chat[2:]]  # the policy's turns and the tools' answers, as before
    first = chat[1]  # the policy's prose, then its call as JSON apart from it, never the raw tags
    assert first.caption[0].value == "policy v2" and first.text[0].value == "Let me check."
    assert "tool call `check`" in [c.value for c in first.caption]
    assert json.loads(first.code[0].value) == {"name": "check", "arguments": {"guess": 8}}
    assert not any("<tool_call>" in t.value for m in chat for t in m.text)
    check = chat[2]  # the tool's answer: its own message, under the tool's name
    assert check.avatar == ":material/build:" and check.caption[0].value == "tool `check`"
    assert [t.value for t in check.text] == ["wrong"] and not check.error
    peek = chat[4]  # an error answer: marked and in red
    assert peek.caption[0].value == "tool `peek` · error" and [e.value for e in peek.error] == [UNKNOWN_TOOL]
    assert not chat[3].text and json.loads(chat[3].code[0].value)["name"] == "peek"
    assert [t.value for t in chat[5].text] == ["9"] and not chat[5].code


def test_the_first_shown_episode_is_shown_without_picking(multiturn_run, monkeypatch):
    """The run's own samples (one policy turn, no tool call): the prompt and that turn, figures from the run."""
    at = open_page(multiturn_run.parent, monkeypatch, "run_detail")
    first = json.loads((multiturn_run / "samples.jsonl").read_text().splitlines()[0])
    assert _episode_box(at).value == 0
    assert [m.name for m in at.chat_message] == ["user", "assistant"]
    assert at.chat_message[1].text[0].value == first["transcript"][0]["content"]
    assert _metric(at, "turns") == "1" and _metric(at, "truncated") == "no"


def test_a_single_turn_run_keeps_its_plain_sample_table(tiny_run, monkeypatch):
    at = open_page(tiny_run.parent, monkeypatch, "run_detail")
    table = _samples_table(at)
    base = ["step", "prompt", "answer", "completion", "reward", "advantage", "score/math_answer"]
    assert list(table.columns) == [*base, "zero-std group", "staleness"]  # no episode figures (its tokens: a picker)
    assert not at.chat_message and "episode" not in [s.label for s in at.selectbox]
    assert "Episodes (multi-turn)" not in [h.value for h in at.subheader]
    assert not any(title in charts(at) for title, _, _ in ENV_CURVES)
