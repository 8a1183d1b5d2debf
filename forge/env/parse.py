"""Tool calls in a sampled turn's text, per model family: the `<tool_call>{json}</tool_call>` convention of
Hermes / Qwen chat templates, else a plain JSON object `{"name": ..., "arguments": {...}}` as the whole turn.

A call that cannot be read becomes a `ToolCall` with `error` set: the episode answers it with the error text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""  # why the call could not be read (then name may be empty)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in `text` (none: the policy answered).

    >>> parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1}, error='')]
    >>> parse_tool_calls('{"name": "add", "arguments": {"a": 1}}')[0].name
    'add'
    >>> parse_tool_calls('<tool_call>{"name": add}</tool_call>')[0].error[:25]
    'Error: malformed tool cal'
    >>> parse_tool_calls('The answer is 7.')
    []
    >>> parse_tool_calls('<tool_call>' + '[' * 100_000)[0].error  # model output never ends the run
    'Error: malformed tool call (JSON nested too deeply)'
    >>> parse_tool_calls('{"name": "f", "arguments": "' + '[' * 100_000 + '"}')[0].error[:36]
    "Error: the arguments of tool 'f' mus"
    """
    tagged = _TAGGED.findall(text)
    if tagged:
        return [_read(body) for body in tagged]
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}") and '"name"' in stripped:
        return [_read(stripped)]
    return []


def _read(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"Error: malformed tool call (invalid JSON: {e.msg}); use "
                                  '{"name": ..., "arguments": {...}}')  # fmt: skip
    except RecursionError:  # model output: ~1,000 nested brackets must not end the run
        return ToolCall("", error="Error: malformed tool call (JSON nested too deeply)")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error='Error: malformed tool call: expected {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some templates send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error=f"Error: the arguments of tool '{call['name']}' must be a JSON object")
    return ToolCall(call["name"], arguments)
