"""OpenEnv environment servers (PyPI `openenv-core`) as the environments of episodes: one WebSocket session each.

The wire protocol, as openenv-core 0.3.0's server implements it (`openenv.core.env_server.http_server`): a WebSocket
at `/ws` is one session with an environment instance of its own. The client sends `{"type": "reset", "data":
{...}}`, `{"type": "step", "data": <action>}`, `{"type": "state"}` and `{"type": "close"}`; the server answers
`{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`, `{"type": "state", ...}` or
`{"type": "error", "data": {"message": ..., "code": ...}}`. HTTP `POST /reset` and `/step` build a fresh
environment per request and close it, so they cannot hold a multi-turn episode: every episode here is a session.

- At start (`connect`): `GET /health`; an unreachable server is one UserError naming the URL (or the key that
  started it). Then sessions are opened and held, up to `env.openenv.max_sessions` (0: one per episode of a step),
  until the server refuses one (CAPACITY_REACHED: it holds at most `max_concurrent_envs`); the number it accepted
  is the cap the run keeps to (`OpenEnvClient.max_sessions`). The first of them lists the tools: an MCP environment
  answers a `list_tools` step with its tools, each one a tool of every episode with its MCP input schema as the
  parameters; another environment (its own typed action) gets one tool, `step`, whose parameters are the action
  schema from `GET /schema` (without `metadata`). Then the sessions are closed.
- Per episode (`OpenEnvEpisode`, what `factory()` returns): `reset(**row)` opens the session and sends the row's
  columns as the reset data (the observation's text is the first observation, None when it is empty); a tool call
  is a step (`{"type": "call_tool", "tool_name", "arguments"}`, or the arguments as the typed action); the answer's
  text goes to the model (an MCP result's text content, else the observation as JSON); the observation's reward and
  done are kept: `reward` is the last reward the server sent (None before any; `rewards` has them all), which
  `env_reward` and reward functions read, and `done` ends the episode after that tool turn.
- Text actions (`env.openenv.text_action`, e.g. `message`: a field of the environment's own action, checked at
  start against its /schema; the only required one): the model needs no tool calls and is offered none. Its plain
  reply goes to `OpenEnvEpisode.on_reply` (the episode loop's reply hook), which sends it as one step
  `{field: reply}`; the observation's text is the environment's answer (a user turn) and the episode goes on, until
  the server says done. As TRL's OpenEnv examples do in their own rollout functions (e.g. echo_env's `message`). `close()` ends the
  session and waits until the server has closed it, so its slot is free for the next episode.
- Failures: a session that cannot open, a connection that drops, a reset or close not answered within
  `env.openenv.timeout_s` set `failure`: the episode loop ends that episode, leaves it out of the loss and counts
  it. So does an answer that is not JSON (or nests too deeply to parse), whose data is not a JSON object, or whose
  reward is not a finite number (`finite_reward`: a string, an array, an object, `1e309` or `Infinity`, which parse
  as inf, `NaN`; a bool counts as 0/1, as openenv-core's own type allows): the failure line names the request and
  what came, e.g. `reset: the answer's reward is not a finite number (received the number inf)`, and no such value
  reaches the reward stage. An error answer to a step (an action that does not fit the schema, an MCP tool error)
  is the tool's error answer, not a failure. A step not answered within `env.tool_timeout_s` is answered with a
  timeout error and the episode goes on; the server's late answer is read and dropped before the session's next
  request.
- A server forgeweave starts (`env.openenv.app`: `python -m uvicorn APP`; `env.openenv.command` with `{port}`)
  runs in a process group of its own on 127.0.0.1 at a free port, its output in a temporary log file. An app serves
  a socket forgeweave bound first (uvicorn's `--fd`: no other local process can take the port in between); a
  command binds its own, and the one listening there once /health answers must be in the server's process group
  (`foreign_listener`, from /proc), else one line: a squatter is never taken for the server. `stop()`
  ends it by its PID (SIGTERM, then SIGKILL) when the run's workers close, after a failure too, and at interpreter
  exit at the latest.
- Ray mode: each rollout actor is a client of its own. A server forgeweave starts is started by each actor on its
  own node (one per actor, so environments scale out with the replicas). The replicas of a run share a server at
  env.openenv.url: the driver finds its session cap once and gives each actor an even share
  (`replica_sessions`). Episodes travel to the reward actor without their session or server (`__getstate__`).

`websockets` (its sync client) is imported inside the functions that use it, so forge imports without it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import weakref
from pathlib import Path

from forge.env.config import EnvConfig, OpenEnvConfig
from forge.env.tools import Tool, ToolError
from forge.errors import UserError
from forge.listeners import foreign_listener

HOST = "127.0.0.1"
SERVER_PYTHON = "FORGEWEAVE_OPENENV_PYTHON"  # the Python that serves env.openenv.app (`server_python`)
ACTION_TOOL = "step"  # the one tool of an environment with its own typed action
_MAX_MESSAGE = 1 << 24  # bytes of one WebSocket message


class SessionLost(Exception):
    """A session's connection failed: it could not open, it dropped, or an answer did not come in time."""


class ServerError(Exception):
    """The server answered a request with an error message (`{"type": "error", "data": ...}`)."""

    def __init__(self, data: dict):
        self.data = data
        super().__init__(" ".join(str(data.get("message", data)).split())[:500])


class Session:
    """One WebSocket session: requests answered in order. `owed`: answers still due to requests that timed out."""

    def __init__(self, ws_url: str, timeout_s: float):
        from websockets.sync.client import connect

        proxy = None if _loopback(ws_url) else True  # a proxy from the environment never reaches this machine's server
        try:
            self.ws = connect(ws_url, open_timeout=timeout_s, close_timeout=timeout_s, max_size=_MAX_MESSAGE,
                              proxy=proxy)  # fmt: skip
        except Exception as e:  # refused, unreachable, a handshake the server rejected, a timeout
            raise SessionLost(f"cannot open a session at {ws_url}: {_why(e)}") from None
        self.timeout_s, self.owed = timeout_s, 0

    def request(self, message: dict, timeout_s: float | None) -> dict:
        """The data of the server's answer to `message`. ServerError for an error answer, SessionLost when the
        connection fails, TimeoutError when none came within `timeout_s` (None: no limit; the answer is then owed)."""
        from websockets.exceptions import ConnectionClosed

        self._settle()
        try:
            self.ws.send(json.dumps(message, default=str))
        except ConnectionClosed:
            pass  # a refusal (at capacity) comes before the server closes: read it below
        except OSError as e:
            raise SessionLost(f"sending failed: {_why(e)}") from None
        reply = self._receive(timeout_s)
        if reply.get("type") == "error":
            raise ServerError(reply.get("data") or {})
        return reply.get("data") or {}

    def close(self) -> None:
        """Ask the server to end the session and wait until it has closed it (its slot is then free)."""
        with contextlib.suppress(Exception):
            self.ws.send('{"type": "close"}')
            while True:  # answers still owed, then the server's close
                self.ws.recv(timeout=self.timeout_s)
        with contextlib.suppress(Exception):
            self.ws.close()

    def _receive(self, timeout_s: float | None) -> dict:
        from websockets.exceptions import ConnectionClosed

        try:
            raw = self.ws.recv(timeout=timeout_s)
        except TimeoutError:
            self.owed += 1
            raise
        except (ConnectionClosed, OSError) as e:
            raise SessionLost(f"the connection was lost: {_why(e)}") from None
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
            raise SessionLost(f"the server sent something that is not JSON: {str(raw)[:100]!r}") from None
        if isinstance(reply, dict) and not isinstance(reply.get("data") or {}, dict):
            raise SessionLost(f"the server's answer has data that is not a JSON object: {str(raw)[:100]!r}")
        return reply if isinstance(reply, dict) else {}

    def _settle(self) -> None:
        """Read and drop the answers owed to timed-out requests (each within env.openenv.timeout_s)."""
        while self.owed:
            self.owed -= 1
            try:
                self._receive(self.timeout_s)
            except TimeoutError:
                raise SessionLost(f"no answer to a timed-out request within {self.timeout_s:g} s") from None


class OpenEnvEpisode:
    """One episode's environment: a session on the OpenEnv server and what its observations said."""

    def __init__(self, client: OpenEnvClient):
        self.client = client
        self.session: Session | None = None
        self.reward: float | None = None  # the last reward the server sent (env_reward reads it)
        self.rewards: list[float] = []  # every reward the server sent, in order
        self.done = False  # the server said the episode is over
        self.failure = ""  # why the session failed ('' = it did not)

    def on_reply(self, reply: str) -> str | None:
        """With text actions (env.openenv.text_action): send the policy's plain reply as one step and return the
        observation's text (the feedback; an error answer or a timeout as an `Error: ...` text), or None once the
        server says done or the session failed. Without them: None (a reply without a tool call ends the episode)."""
        field = self.client.text_field
        if not field or self.session is None or self.done:
            return None
        timeout = self.client.tool_timeout_s or None
        try:
            data = self.session.request({"type": "step", "data": {field: reply}}, timeout)
        except TimeoutError:
            return f"Error: the environment did not answer within {timeout:g} s"
        except ServerError as e:
            return f"Error: {e}"
        except SessionLost as e:
            self._fail(f"step: {e}")
            return None
        observation = self._observe(data, "step")
        return None if self.done or self.failure else answer_text(observation)[0]

    def reset(self, **row) -> str | None:
        """Open the session and reset it with the row's columns; the first observation's text (None: empty)."""
        try:
            self.session = Session(self.client.ws_url, self.client.timeout_s)
            data = self.session.request({"type": "reset", "data": row}, self.client.timeout_s)
        except TimeoutError:
            self._fail(f"reset: no answer within {self.client.timeout_s:g} s (env.openenv.timeout_s)")
            return None
        except (SessionLost, ServerError) as e:  # gone, or refused (e.g. at capacity: another client holds slots)
            self._fail(f"reset: {e}")
            return None
        return observation_text(self._observe(data, "reset"))

    def tools(self) -> list[Tool]:
        """The server's tools, each a step on this episode's session."""
        return [self._tool(schema) for schema in self.client.schemas]

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def _tool(self, schema: dict) -> Tool:
        name = schema["function"]["name"]

        def call(**arguments) -> str:
            return self._call(name, arguments)

        return Tool(name, call, schema, times_itself=True)

    def _call(self, name: str, arguments: dict) -> str:
        """One tool call as a step: the answer's text; a ToolError for an error answer, a timeout or a failure."""
        if self.session is None:
            raise ToolError(f"Error: the environment session is closed ({self.failure or 'the episode is over'})")
        timeout = self.client.tool_timeout_s or None
        try:
            data = self.session.request({"type": "step", "data": self.client.action(name, arguments)}, timeout)
        except TimeoutError:
            raise ToolError(f"Error: tool '{name}' timed out after {timeout:g} s") from None
        except ServerError as e:
            raise ToolError(f"Error: tool '{name}': {e}") from None
        except SessionLost as e:
            self._fail(f"step: {e}")
            raise ToolError(f"Error: the environment failed ({e})") from None
        text, error = answer_text(self._observe(data, "step"))
        if self.failure:  # the answer itself was refused (its reward)
            raise ToolError(f"Error: the environment failed ({self.failure})")
        if error:
            raise ToolError(f"Error: tool '{name}': {text}")
        return text

    def _observe(self, data: dict, request: str) -> dict:
        """Keep the answer's reward and done; its observation. A reward that is not a finite number fails the
        episode (`request` names the request in the line), so that it never reaches the reward stage."""
        reward = data.get("reward")
        if reward is not None:
            value = finite_reward(reward)
            if value is None:
                self._fail(f"{request}: the answer's reward is not a finite number (received {_shown(reward)})")
            else:
                self.reward = value
                self.rewards.append(value)
        self.done = bool(data.get("done"))
        observation = data.get("observation")
        return observation if isinstance(observation, dict) else {}

    def _fail(self, why: str) -> None:
        self.failure = self.failure or f"OpenEnv server {self.client.url}: {why}"
        self.close()

    def __getstate__(self) -> dict:
        """A copy for another process (Ray: the reward actor reads `reward`, `rewards`, `done`): no session."""
        return {**self.__dict__, "session": None}


class OpenEnvClient:
    """The environment factory of a run with an OpenEnv server: `client()` is a new episode's environment.
    `max_sessions`: episodes open at once (the cap found at start); `schemas`: the tools listed at start."""

    def __init__(self, url: str, schemas: list[dict], mcp: bool, max_sessions: int, cfg: EnvConfig,
                 server: LocalServer | None = None):  # fmt: skip
        self.url, self.schemas, self.mcp, self.max_sessions = url, schemas, mcp, max_sessions
        self.timeout_s, self.tool_timeout_s = cfg.openenv.timeout_s, cfg.tool_timeout_s
        self.text_field = cfg.openenv.text_action  # '' = the policy acts by tool calls
        self.server = server

    @property
    def ws_url(self) -> str:
        return _ws(self.url)

    def __call__(self) -> OpenEnvEpisode:
        return OpenEnvEpisode(self)

    def action(self, name: str, arguments: dict) -> dict:
        """The step action of a tool call: an MCP call_tool, or the arguments as the environment's own action."""
        return {"type": "call_tool", "tool_name": name, "arguments": arguments} if self.mcp else dict(arguments)

    def close(self) -> None:
        """Stop the server if forgeweave started it."""
        if self.server is not None:
            self.server.stop()

    def __getstate__(self) -> dict:
        """A copy for another process (with the episodes it made): the server stays with the process that runs it."""
        return {**self.__dict__, "server": None}


def connect(cfg: EnvConfig, episodes: int) -> OpenEnvClient:
    """The client of the run's OpenEnv server (started first for env.openenv.app / env.openenv.command), checked:
    healthy, its session cap (at most `episodes` sessions are tried: the episodes of a step) and its tools."""
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        raise UserError(f"{cfg.server_key}: talking to an OpenEnv server needs the `websockets` package (>= 15; "
                        "Prefect brings it): pip install websockets") from None  # fmt: skip
    server = LocalServer.start(cfg.openenv) if cfg.openenv.app or cfg.openenv.command else None
    try:
        url = server.url if server else cfg.openenv.url.rstrip("/")
        what = server.what + f" (at {url})" if server else f"env.openenv.url={url!r}"
        if server is None and not _healthy(url, cfg.openenv.timeout_s):
            raise UserError(f"{what}: no OpenEnv server answers {url}/health: start it, or fix the URL")
        sessions = _open_sessions(url, cfg.openenv.max_sessions or episodes, cfg.openenv.timeout_s, what)
        try:
            if len(sessions) < cfg.openenv.max_sessions:
                raise UserError(f"env.openenv.max_sessions={cfg.openenv.max_sessions}, but {what} accepts only "
                                f"{len(sessions)} sessions at once: lower it (0: as many as it accepts)")  # fmt: skip
            schemas, mcp = _list_tools(sessions[0], url, cfg.openenv.timeout_s, what)
            if cfg.openenv.text_action:  # the policy answers with text: no tool is offered
                schemas = _check_text_action(cfg.openenv.text_action, schemas, mcp, what)
        finally:
            for s in sessions:
                s.close()
        return OpenEnvClient(url, schemas, mcp, len(sessions), cfg, server)
    except BaseException:
        if server is not None:
            server.stop()
        raise


def replica_sessions(cfg: EnvConfig, episodes: int, replicas: int) -> int:
    """Sessions each of `replicas` rollout processes may hold on the shared server at env.openenv.url: its session
    cap (env.openenv.max_sessions, or what it accepts, found once here) split evenly, so that the replicas together
    never ask for more than the server holds."""
    client = connect(cfg, episodes)
    share = client.max_sessions // replicas
    if share < 1:
        raise UserError(f"env.openenv.url={client.url!r}: the server holds {client.max_sessions} sessions at once, "
                        f"fewer than rollout.replicas={replicas} (one each): lower rollout.replicas or raise its "
                        "max_concurrent_envs")  # fmt: skip
    return share


def _open_sessions(url: str, want: int, timeout_s: float, what: str) -> list[Session]:
    """Up to `want` sessions held open at once, fewer if the server refuses one (at capacity); at least one."""
    ws_url, sessions = _ws(url), []
    try:
        while len(sessions) < want:
            session = Session(ws_url, timeout_s)
            try:
                session.request({"type": "state"}, timeout_s)  # the session exists once it is answered
            except ServerError as e:
                if e.data.get("code") == "CAPACITY_REACHED":
                    session.close()
                    break
            sessions.append(session)
    except (SessionLost, TimeoutError) as e:
        for s in sessions:
            s.close()
        raise UserError(f"{what}: opening session {len(sessions) + 1} failed ({_why(e)})") from None
    if not sessions:
        raise UserError(f"{what}: the server accepts no session (it is at capacity): free it, or raise its "
                        "max_concurrent_envs")  # fmt: skip
    return sessions


def _list_tools(session: Session, url: str, timeout_s: float, what: str) -> tuple[list[dict], bool]:
    """(the tool schemas, whether the environment is MCP): its MCP tools, else one tool for its typed action."""
    try:
        data = session.request({"type": "step", "data": {"type": "list_tools"}}, timeout_s)
        listed = (data.get("observation") or {}).get("tools")
    except ServerError:  # not an MCP environment: its own action type refused the list_tools action
        listed = None
    except (SessionLost, TimeoutError) as e:
        raise UserError(f"{what}: listing its tools failed ({_why(e)})") from None
    if isinstance(listed, list):
        if not listed:
            raise UserError(f"{what}: the MCP environment lists no tools: the policy could not act")
        return [mcp_schema(t) for t in listed], True
    try:
        action = _get_json(f"{url}/schema", timeout_s)["action"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{what}: neither MCP tools nor an action schema at {url}/schema ({_why(e)})") from None
    return [action_schema(action)], False


def _check_text_action(field: str, schemas: list[dict], mcp: bool, what: str) -> list[dict]:
    """No tool schemas (the policy answers with text) once `field` is checked to be a text field of the server's own
    action and the only one it requires; a UserError naming the key otherwise."""
    key = f"env.openenv.text_action={field!r}"
    if mcp:
        raise UserError(f"{key}: {what} is an MCP environment (its actions are tool calls): clear the key")
    params = schemas[0]["function"]["parameters"]
    fields = params.get("properties", {})
    if field not in fields or fields[field].get("type", "string") != "string":
        raise UserError(f"{key}: {what}'s action has no text field {field!r}; its fields: {sorted(fields)}")
    others = [f for f in params.get("required", []) if f != field]
    if others:
        raise UserError(f"{key}: {what}'s action also requires {others}, which a reply cannot fill: use tool calls")
    return []


def mcp_schema(tool: dict) -> dict:
    """The tool schema (chat-template form) of an MCP tool as list_tools gives it.

    >>> mcp_schema({"name": "check", "description": "Check.", "input_schema": {"type": "object"}})["function"]
    {'name': 'check', 'description': 'Check.', 'parameters': {'type': 'object'}}
    """
    parameters = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    function = {"name": str(tool.get("name", "")), "description": str(tool.get("description") or ""),
                "parameters": parameters}  # fmt: skip
    return {"type": "function", "function": function}


def action_schema(action: dict) -> dict:
    """The one tool of an environment with its own action type: `step`, its parameters the action's JSON schema
    without the `metadata` field every OpenEnv action has.

    >>> s = action_schema({"title": "EchoAction", "description": "Echo a message.", "type": "object",
    ...                    "properties": {"metadata": {"type": "object"}, "message": {"type": "string"}},
    ...                    "required": ["message"]})
    >>> s["function"]["name"], s["function"]["parameters"]["properties"]
    ('step', {'message': {'type': 'string'}})
    """
    parameters = {k: v for k, v in action.items() if k not in ("title", "description")}
    parameters["properties"] = {k: v for k, v in action.get("properties", {}).items() if k != "metadata"}
    if "required" in action:
        parameters["required"] = [k for k in action["required"] if k != "metadata"]
    description = action.get("description") or f"Take one action ({action.get('title', 'the environment action')})."
    return {"type": "function", "function": {"name": ACTION_TOOL, "description": description, "parameters": parameters}}


def answer_text(observation: dict) -> tuple[str, bool]:
    """(the text the model reads, whether it is an error) of a step's observation: an MCP call_tool result's text
    content (its error message, if any), else the observation itself.

    >>> answer_text({"tool_name": "check", "result": {"content": [{"type": "text", "text": "right"}]}, "error": None})
    ('right', False)
    >>> answer_text({"tool_name": "x", "result": None, "error": {"error_type": "tool_not_found", "message": "no"}})
    ('no', True)
    >>> answer_text({"echoed_message": "hi", "message_length": 2})
    ('{"echoed_message": "hi", "message_length": 2}', False)
    """
    if "tool_name" not in observation:
        return observation_text(observation) or "(empty observation)", False
    error = observation.get("error")
    if error:
        return str(error.get("message", error) if isinstance(error, dict) else error), True
    result = observation.get("result")
    if not isinstance(result, dict):
        return result if isinstance(result, str) else json.dumps(result, default=str), False
    content = result.get("content") or []
    texts = [c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"]
    text = "\n".join(texts) if texts else json.dumps(result.get("structured_content", result.get("data")), default=str)
    return text, bool(result.get("is_error"))


def finite_reward(value) -> float | None:
    """An answer's reward as a float: a finite JSON number, or a bool (openenv-core's `Observation.reward` is `bool |
    int | float | None`); None for anything else: a string, an array, an object, a number beyond float (JSON's
    `1e309`, which Python's json reads as inf; an integer of 400 digits), `Infinity` or `NaN`.

    >>> finite_reward(1), finite_reward(-0.5), finite_reward(True)
    (1.0, -0.5, 1.0)
    >>> [finite_reward(json.loads(t)) for t in ('1e309', 'NaN', '"1.0"', '[1]', '{"r": 1}', '1' + '0' * 400)]
    [None, None, None, None, None, None]
    """
    if not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _shown(value) -> str:
    """A JSON value for a one-line message: its kind and at most ~60 characters of it (inf and nan as Python names
    them, which is what a `1e309` or `Infinity` became)."""
    kinds = {str: "the string", list: "the array", dict: "the object"}
    text = repr(value) if isinstance(value, float) else " ".join(json.dumps(value, default=str).split())
    return f"{kinds.get(type(value), 'the number')} {text if len(text) <= 60 else text[:57] + '...'}"


def observation_text(observation: dict) -> str | None:
    """An observation as text: None when empty, its one string field alone (None if that is empty), else its JSON.

    >>> observation_text({}), observation_text({"prompt": "Add 3 and 4."}), observation_text({"a": 1})
    (None, 'Add 3 and 4.', '{"a": 1}')
    """
    if not observation:
        return None
    values = list(observation.values())
    if len(values) == 1 and isinstance(values[0], str):
        return values[0] or None
    return json.dumps(observation, default=str)


class LocalServer:
    """An OpenEnv server forgeweave runs for the run: its process (a process group of its own) and URL."""

    def __init__(self, proc: subprocess.Popen, url: str, what: str, log: Path):
        self.proc, self.url, self.what, self.log = proc, url, what, log
        self._stop = weakref.finalize(self, _stop_process, proc, log)  # at interpreter exit at the latest

    @classmethod
    def start(cls, cfg: OpenEnvConfig, port: int = 0) -> LocalServer:
        """Start env.openenv.app (uvicorn) or env.openenv.command on 127.0.0.1 at `port` (0: a free one); wait for
        /health. An app is served on a socket bound here first and handed to uvicorn (`--fd`), so no other process
        can hold its port; a command binds its port itself, so once /health answers the listener must be the
        started process (or one of its process group), else one line: another process answers there."""
        listener = _listener(port) if cfg.app else None
        port = listener.getsockname()[1] if listener else port or _free_port()
        if listener:
            what = f"env.openenv.app={cfg.app!r}"
            argv = [server_python(), "-m", "uvicorn", cfg.app, "--fd", str(listener.fileno()), "--log-level", "warning"]
        else:
            what = f"env.openenv.command={cfg.command!r}"
            argv = [a.replace("{port}", str(port)).replace("{host}", HOST) for a in shlex.split(cfg.command)]
        fd, log = tempfile.mkstemp(prefix="forge-openenv-", suffix=".log")
        try:
            fds = [listener.fileno()] if listener else []
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                                    start_new_session=True, pass_fds=fds)  # fmt: skip
        except OSError as e:
            Path(log).unlink(missing_ok=True)
            raise UserError(f"{what}: cannot start it ({_why(e)}): fix the command") from None
        finally:
            os.close(fd)
            if listener:
                listener.close()  # the server holds its own copy
        server = cls(proc, f"http://{HOST}:{port}", what, Path(log))
        server.wait_healthy(cfg.start_timeout_s)
        if not listener and (other := foreign_listener(port, proc.pid)):
            server.stop()
            raise UserError(f"{what}: {server.url} is answered by another process ({other}), not the server "
                            "forgeweave started: stop that process or let forgeweave pick the port")  # fmt: skip
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once /health answers; a UserError (the server stopped) if it exits or stays silent."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                why = f"it exited with code {self.proc.returncode} before answering {self.url}/health"
                break
            if _healthy(self.url, 1.0):
                return
            time.sleep(0.1)
        else:
            why = f"no answer from {self.url}/health within {timeout_s:g} s (env.openenv.start_timeout_s)"
        last = _last_line(self.log)
        self.stop()
        raise UserError(f"{self.what}: {why}" + (f"; its last output: {last}" if last else ""))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        """End the server by its PID (its process group: SIGTERM, then SIGKILL after 5 s); idempotent."""
        self._stop()


def server_python() -> str:
    """The Python that serves env.openenv.app: this one, or the one named by $FORGEWEAVE_OPENENV_PYTHON (Ray sets it
    to the driver's for rollout actors run by vLLM's venv, which has no openenv-core) where that path exists."""
    named = os.environ.get(SERVER_PYTHON, "")
    return named if named and Path(named).exists() else sys.executable


def _stop_process(proc: subprocess.Popen, log: Path) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    log.unlink(missing_ok=True)


def _healthy(url: str, timeout_s: float) -> bool:
    try:
        return isinstance(_get_json(f"{url}/health", timeout_s), dict)
    except (OSError, ValueError):
        return False


def _get_json(url: str, timeout_s: float):
    handlers = [urllib.request.ProxyHandler({})] if _loopback(url) else []  # as for the WebSocket: no proxy here
    with urllib.request.build_opener(*handlers).open(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def _loopback(url: str) -> bool:
    """Whether `url` names this machine.

    >>> _loopback("ws://127.0.0.1:8000/ws"), _loopback("http://localhost:1"), _loopback("https://env.example")
    (True, True, False)
    """
    return urllib.parse.urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")


def _ws(url: str) -> str:
    """The WebSocket session endpoint of a server at http(s) `url`.

    >>> _ws("http://127.0.0.1:8000"), _ws("https://env.example")
    ('ws://127.0.0.1:8000/ws', 'wss://env.example/ws')
    """
    return "ws" + url.removeprefix("http") + "/ws"


def _listener(port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:`port` (0: a free one), for the server forgeweave starts to serve on; a
    port another process holds is one line."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as uvicorn does when it binds: a port whose last server's connections linger in TIME_WAIT (a server restarted at
    # its address) binds again; one another socket listens on still does not
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UserError(
            f"OpenEnv server: {HOST}:{port} is taken ({_why(e)}): free it or let forgeweave pick the port"
        ) from None
    return sock


def _free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later: a small race, retried by nobody)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _why(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]
