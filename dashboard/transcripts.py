"""Multi-turn samples read for display: a samples.jsonl `transcript` (the segments forge's episode loop records,
forge/env/episode.py) as chat messages, the policy's tool calls split out of its turns, and the episode's figures.

Tool calls are found by the conventions forge's rollout parses (`<tool_call>{json}</tool_call>` blocks of
Hermes/Qwen chat templates, else a plain JSON object `{"name": ..., ...}` as the whole turn), read here again
rather than imported: the dashboard imports no forge code. This only splits a turn's text for showing it; which
calls were made and how each was answered is what the transcript's tool segments say.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # an unclosed last block runs to the end


@dataclass(frozen=True)
class Part:
    """A piece of a policy turn: prose, or one tool call."""

    kind: str  # "text" or "call"
    text: str  # the prose; for a call its JSON pretty-printed, or its raw text when that is not a JSON object
    name: str = ""  # the called tool ("" for prose or a call that cannot be read)


@dataclass(frozen=True)
class Message:
    """One chat message of an episode."""

    role: str  # "user" (the prompt, user turns), "environment" (reset's first observation), "assistant" (the
    # policy's turns), "tool" (a tool's answer)
    parts: list[Part] = field(default_factory=list)  # in order; one text part except in assistant turns
    name: str = ""  # tool: the tool that answered ("" when the call could not be read)
    policy_version: int | None = None  # assistant: the policy version that sampled the turn
    error: bool = False  # tool: the answer is an error (malformed call, unknown tool, raised, timed out)


@dataclass(frozen=True)
class Figures:
    """An episode's figures, as samples.jsonl's `episode` records them (counted from the transcript if absent)."""

    turns: int  # policy turns
    tool_calls: int
    tool_errors: int
    truncated: bool | None  # cut by a limit; None: not recorded (samples written before `episode` existed)


def is_multiturn(sample: dict) -> bool:
    return isinstance(sample.get("transcript"), list)


def split_calls(text: str) -> list[Part]:
    """A policy turn as prose and tool-call parts, in order; blank prose between calls is dropped.

    >>> [(p.kind, p.name) for p in split_calls('Checking. <tool_call>{"name": "check"}</tool_call>')]
    [('text', ''), ('call', 'check')]
    >>> [p.kind for p in split_calls('{"name": "check", "arguments": {"guess": 9}}')], split_calls("9")[0].text
    (['call'], '9')
    """
    if TAGGED.search(text) is None:
        stripped = text.strip()
        plain = stripped.startswith("{") and stripped.endswith("}") and '"name"' in stripped
        return [call_part(stripped)] if plain else [Part("text", text)]
    parts, at = [], 0
    for m in TAGGED.finditer(text):
        parts += [Part("text", text[at : m.start()].strip())] + [call_part(m.group(1))]
        at = m.end()
    parts.append(Part("text", text[at:].strip()))
    return [p for p in parts if p.kind == "call" or p.text]


def call_part(body: str) -> Part:
    """A call's part: its JSON pretty-printed with the tool's name, else the raw text with no name.

    >>> call_part('{"name": "check", "arguments": {"guess": 9}}').name, call_part("{name: check}").text
    ('check', '{name: check}')
    """
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return Part("call", body.strip())
    name = call.get("name") if isinstance(call, dict) else None
    return Part("call", json.dumps(call, indent=2, ensure_ascii=False), name if isinstance(name, str) else "")


def messages(prompt: str, transcript: list[dict]) -> list[Message]:
    """The prompt as a user message, then one message per transcript segment."""
    return [Message("user", [Part("text", str(prompt))]), *(segment_message(s) for s in transcript)]


def segment_message(segment: dict) -> Message:
    role, content = str(segment.get("role", "user")), str(segment.get("content", ""))
    if role == "assistant":
        return Message(role, split_calls(content), policy_version=segment.get("policy_version"))
    if role == "tool":
        return Message(role, [Part("text", content)], str(segment.get("name") or ""), error=bool(segment.get("error")))
    return Message(role, [Part("text", content)])


def figures(sample: dict) -> Figures:
    """The sample's `episode` figures; for a sample without them, turns and calls counted from its transcript.

    >>> figures({"transcript": [{"role": "assistant"}, {"role": "tool", "error": True}, {"role": "assistant"}]})
    Figures(turns=2, tool_calls=1, tool_errors=1, truncated=None)
    """
    segments = sample.get("transcript") or []
    tools = [s for s in segments if s.get("role") == "tool"]
    counted = {"turns": sum(s.get("role") == "assistant" for s in segments), "tool_calls": len(tools)}
    recorded = {**counted, "tool_errors": sum(bool(s.get("error")) for s in tools), **(sample.get("episode") or {})}
    truncated = recorded.get("truncated")
    return Figures(
        int(recorded["turns"]),
        int(recorded["tool_calls"]),
        int(recorded["tool_errors"]),
        None if truncated is None else bool(truncated),
    )
