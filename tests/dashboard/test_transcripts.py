"""dashboard.transcripts and the multi-turn columns of dashboard.data.samples_frame: tool calls split out of a
policy turn by the conventions forge parses, the transcript as chat messages, the episode's figures (recorded, or
counted from the transcript for samples written before samples.jsonl carried them)."""

import doctest

import pandas as pd

from dashboard import data, transcripts
from dashboard.transcripts import Part

CHECK = '{"name": "check", "arguments": {"guess": 8}}'
PRETTY = '{\n  "name": "check",\n  "arguments": {\n    "guess": 8\n  }\n}'


def test_the_doctests_hold():
    assert doctest.testmod(transcripts).failed == 0


def test_tagged_calls_are_split_from_the_prose_in_order():
    text = f"First. <tool_call>{CHECK}</tool_call> then <tool_call>{{bad}}</tool_call>"
    assert transcripts.split_calls(text) == [
        Part("text", "First."),
        Part("call", PRETTY, "check"),
        Part("text", "then"),
        Part("call", "{bad}"),  # unreadable: its raw text, no tool name
    ]
    assert transcripts.split_calls(f"<tool_call>{CHECK}") == [Part("call", PRETTY, "check")]  # cut before the tag


def test_a_plain_json_turn_is_a_call_and_anything_else_prose():
    assert transcripts.split_calls(f"  {CHECK}\n") == [Part("call", PRETTY, "check")]
    assert transcripts.split_calls('{"guess": 8}') == [Part("text", '{"guess": 8}')]  # no "name": not a call
    assert transcripts.split_calls("") == [Part("text", "")]


def test_messages_follow_the_transcript():
    segments = [
        {"role": "assistant", "content": f"<tool_call>{CHECK}</tool_call>", "policy_version": 4},
        {"role": "tool", "name": "check", "content": "wrong", "error": False},
        {"role": "tool", "name": "", "content": "Error: malformed tool call", "error": True},
        {"role": "user", "content": "try again"},
    ]
    out = transcripts.messages("4+5=", segments)
    assert [(m.role, m.name, m.policy_version, m.error) for m in out] == [
        ("user", "", None, False),
        ("assistant", "", 4, False),
        ("tool", "check", None, False),
        ("tool", "", None, True),
        ("user", "", None, False),
    ]
    assert out[0].parts == [Part("text", "4+5=")] and out[2].parts == [Part("text", "wrong")]


def test_figures_recorded_or_counted():
    recorded = {"transcript": [], "episode": {"turns": 4, "tool_calls": 3, "tool_errors": 0, "truncated": True}}
    assert transcripts.figures(recorded) == transcripts.Figures(4, 3, 0, True)
    assert transcripts.figures({"transcript": []}) == transcripts.Figures(0, 0, 0, None)


def test_samples_frame_of_a_multiturn_file_with_an_older_row():
    tool = {"role": "tool", "name": "check", "content": "wrong", "error": False}
    rows = [
        {"step": 1, "prompt": "p", "completion": "c", "reward": 0.0, "transcript": [{"role": "assistant"}, tool]},
        {"step": 1, "prompt": "p", "completion": "c", "reward": 1.0},  # no transcript: no figures
        {
            "step": 2,
            "prompt": "p",
            "completion": "c",
            "reward": 1.0,
            "transcript": [],
            "episode": {"turns": 2, "tool_calls": 1, "tool_errors": 1, "truncated": True},
        },
    ]
    frame = data.samples_frame(rows)
    assert [str(frame[c].dtype) for c in data.EPISODE_COLUMNS] == ["Int64", "Int64", "Int64", "boolean"]
    figures = [[None if pd.isna(v) else v for v in r] for r in frame[list(data.EPISODE_COLUMNS)].values.tolist()]
    assert figures == [[1, 1, 0, None], [None, None, None, None], [2, 1, 1, True]]
    assert frame["transcript"].notna().tolist() == [True, False, True]
    single = data.samples_frame([{"step": 1, "prompt": "p", "completion": "c", "reward": 1.0}])
    assert "transcript" not in single.columns and not set(data.EPISODE_COLUMNS) & set(single.columns)
