"""Tools of an episode: stateless functions (`tools=[fn, ...]`) and the public methods of a TRL-style environment
instance, each with the JSON schema transformers derives from its signature and docstring (`get_json_schema`, the
schema TRL and chat templates use), and the call that turns any failure into an error text for the model.

As in TRL, every public method of an environment class except `reset` is a tool. Departure: methods named
`reward` (the environment's reward, `forge.env.rewards.env_reward`) and `on_reply` (its feedback on a reply without a
tool call, `forge.env.episode`) are not tools either.
"""

from __future__ import annotations

import importlib
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

from forge.errors import UserError

NOT_TOOLS = ("reset", "reward", "on_reply")  # on_reply: forge.env.episode.REPLY_HOOK
MAX_STUCK_TOOLS = 16
"""Tool calls a process lets run on past env.tool_timeout_s (Python cannot kill a thread: each holds one until its
tool returns). With this many still running, a tool call is refused (`ToolsExhausted`: its episode fails) rather
than start one more thread that may never end."""
_stuck: list[threading.Thread] = []
_stuck_lock = threading.Lock()


class ToolError(Exception):
    """A tool's own error answer (e.g. a remote server's): its text goes to the model as is and counts as an error."""


class ToolsExhausted(Exception):
    """MAX_STUCK_TOOLS tool calls are still running past their timeout: the episode that wants another one fails."""


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
    error text the model reads (a `ToolError`'s text as it is). The one exception: `ToolsExhausted`, when
    MAX_STUCK_TOOLS earlier calls still run past their timeout (the caller fails the episode)."""
    if name not in tools:
        return f"Error: unknown tool '{name}'; available: {', '.join(tools) or 'none'}", True
    tool = tools[name]
    if not tool.times_itself:
        _claim_thread(name)
    try:
        if tool.times_itself:
            result = tool.fn(**arguments)
        else:
            finished, result = _timed_call(name, tool.fn, arguments, timeout_s)
            if not finished:  # its thread runs on, unread (counted in _stuck until it ends)
                return f"Error: tool '{name}' timed out after {timeout_s:g} s", True
    except ToolError as e:
        return str(e), True
    except Exception as e:  # the tool raised (or got arguments it does not take)
        return f"Error: tool '{name}' raised {type(e).__name__}: {e}", True
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False


def _claim_thread(name: str) -> None:
    """ToolsExhausted when MAX_STUCK_TOOLS earlier calls are still running past their timeout."""
    with _stuck_lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        if len(_stuck) >= MAX_STUCK_TOOLS:
            raise ToolsExhausted(
                f"tool '{name}' not called: {len(_stuck)} earlier tool calls still run past env.tool_timeout_s "
                "(a thread cannot be stopped); fix the tool that hangs"
            )


def _timed_call(name: str, fn: Callable, arguments: dict, timeout_s: float) -> tuple[bool, object]:
    """(finished, fn(**arguments)), run in a daemon thread of its own and waited for `timeout_s` (0: for ever); the
    tool's exception is raised here. A thread past its timeout runs on, counted in `_stuck` until it ends; being a
    daemon, it does not keep the process from exiting."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(**arguments)
        except Exception as e:
            box["error"] = e
        except BaseException as e:  # SystemExit in a tool is the tool's error, not the run's end
            box["error"] = RuntimeError(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=run, name=f"forge-tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s or None)
    if thread.is_alive():
        with _stuck_lock:
            _stuck.append(thread)
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box.get("value")


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
