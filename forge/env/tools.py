"""Tools of an episode: stateless functions (`tools=[fn, ...]`) and the public methods of a TRL-style environment
instance, each with the JSON schema transformers derives from its signature and docstring (`get_json_schema`, the
schema TRL and chat templates use), and the call that turns any failure into an error text for the model.

As in TRL, every public method of an environment class except `reset` is a tool. Departure: methods named
`reward` (the environment's reward, `forge.env.rewards.env_reward`) and `on_reply` (its feedback on a reply without a
tool call, `forge.env.episode`) are not tools either.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

from forge.errors import UserError

NOT_TOOLS = ("reset", "reward", "on_reply")  # on_reply: forge.env.episode.REPLY_HOOK
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="forge-tool")


class ToolError(Exception):
    """A tool's own error answer (e.g. a remote server's): its text goes to the model as is and counts as an error."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable  # a function, or a bound method of the episode's environment
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    times_itself: bool = False  # fn enforces env.tool_timeout_s itself (a remote call): called in the caller's thread


def tool_of(fn: Callable, owner: str = "") -> Tool:
    """The tool for `fn`; a function without a docstring or with an undocumented argument is a UserError naming it."""
    what = f"{owner}.{fn.__name__}" if owner else getattr(fn, "__qualname__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        why = " ".join(str(e).split())
        raise UserError(
            f"tool {what}: {why}; give it type hints and a docstring with an Args: section (docs/environments.md)"
        ) from None
    schema["function"].pop("return", None)
    return Tool(fn.__name__, fn, schema)


def environment_tools(env: object) -> list[Tool]:
    """Every public method of the environment instance `env` (but those in NOT_TOOLS) as a tool."""
    cls = type(env).__name__
    names = [n for n, _ in inspect.getmembers(type(env), callable) if not n.startswith("_") and n not in NOT_TOOLS]
    return [tool_of(getattr(env, n), cls) for n in names]


def check_environment(factory: Callable) -> None:
    """The class contract, at start: a no-argument constructor and a `reset` method; else one line naming it."""
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        env = factory()
    except Exception as e:
        raise UserError(
            f"environment {name}() failed ({type(e).__name__}: {e}): it must build with no arguments"
        ) from None
    if not callable(getattr(env, "reset", None)):
        raise UserError(f"environment {name} has no reset method: add reset(self, **row) returning a str or None")
    environment_tools(env)  # every tool documented


def call_tool(tools: dict[str, Tool], name: str, arguments: dict, timeout_s: float) -> tuple[str, bool]:
    """(the tool's answer as text, whether it is an error). Unknown tool, bad arguments, a raise or a timeout: an
    error text the model reads, never an exception (a `ToolError`'s text as it is)."""
    if name not in tools:
        return f"Error: unknown tool '{name}'; available: {', '.join(tools) or 'none'}", True
    tool = tools[name]
    try:
        if tool.times_itself:
            result = tool.fn(**arguments)
        else:
            result = _POOL.submit(tool.fn, **arguments).result(timeout=timeout_s or None)
    except concurrent.futures.TimeoutError:
        return f"Error: tool '{name}' timed out after {timeout_s:g} s", True  # its thread runs on, unread
    except ToolError as e:
        return str(e), True
    except Exception as e:  # the tool raised (or got arguments it does not take)
        return f"Error: tool '{name}' raised {type(e).__name__}: {e}", True
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False


def load_object(spec: str, key: str) -> object:
    """The object a config import path 'pkg.mod:name' names (or the one forge.train was given under it)."""
    from forge.rewards.registry import provided_object

    if (obj := provided_object(spec)) is not None:
        return obj
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise UserError(f"config key '{key}': '{spec}' must look like 'pkg.module:name'")
    try:
        obj = importlib.import_module(module)
    except Exception as e:
        raise UserError(f"config key '{key}': cannot import '{module}' ({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise UserError(f"config key '{key}': module '{module}' has no attribute '{attr}'")
    return obj
