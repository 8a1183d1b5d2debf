"""Rows of the MLflow sample tables: a samples.jsonl row made flat, with a multi-turn episode's transcript as text.

A single-turn row is only flattened (`{"scores": {"v": 1.0}}` -> `scores.v`). A multi-turn row (one with a
`transcript`, see `forge.rundir.append_samples`) gets its transcript twice: `transcript`, the segments as readable
text (one block per segment, headed by its role: the policy version of an assistant turn, the tool's name of an
answer, `error` where the answer is an error), and `transcript_json`, the segments as a JSON string for code that
reads the table back. Its figures come flattened from the row: `episode.turns`, `episode.tool_calls`,
`episode.tool_errors`, `episode.truncated`, `episode.masked`. Cells stay scalar: MLflow's table viewer shows nested
values poorly (so the rows forge hands the tracker leave out samples.jsonl's per-token `tokens`).
"""

from __future__ import annotations

import json

from forge.rundir import flatten


def table_row(row: dict) -> dict:
    """One row of a sample table: `row` flattened, its transcript (if any) as text plus a JSON column.

    >>> table_row({"step": 1, "scores": {"v": 1.0}})
    {'step': 1, 'scores.v': 1.0}
    >>> seg = [{"role": "assistant", "content": "7", "policy_version": 0}]
    >>> r = table_row({"step": 1, "transcript": seg, "episode": {"turns": 1}})
    >>> list(r), r["transcript"], json.loads(r["transcript_json"]) == seg
    (['step', 'transcript', 'episode.turns', 'transcript_json'], '[assistant · policy v0]\\n7', True)
    """
    segments = row.get("transcript")
    if segments is None:
        return flatten(row)
    text = transcript_text(segments)
    return {**flatten({**row, "transcript": text}), "transcript_json": json.dumps(segments, ensure_ascii=False)}


def transcript_text(segments: list[dict]) -> str:
    """The segments as text blocks separated by a blank line, each headed by `[role ...]`.

    >>> print(transcript_text([{"role": "tool", "name": "check", "content": "wrong", "error": False},
    ...                        {"role": "tool", "name": "peek", "content": "Error: unknown", "error": True}]))
    [tool check]
    wrong
    <BLANKLINE>
    [tool peek · error]
    Error: unknown
    """
    return "\n\n".join(f"[{segment_heading(s)}]\n{s.get('content', '')}" for s in segments)


def segment_heading(segment: dict) -> str:
    """`assistant · policy v3`, `tool check`, `tool check · error`, or the bare role of another segment."""
    role = str(segment.get("role", "?"))
    if role == "assistant" and segment.get("policy_version") is not None:
        return f"assistant · policy v{segment['policy_version']}"
    if role == "tool":
        return f"tool {segment.get('name') or '(unreadable call)'}" + (" · error" if segment.get("error") else "")
    return role
