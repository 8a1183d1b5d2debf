"""`env`: the environment and tools of multi-turn episodes (forge/env/episode.py), with its sections `env.openenv`
(an OpenEnv server: forge/env/openenv.py) and `env.agent` (an agent written against the OpenAI API:
forge/env/agent.py). Stdlib only: `forge.config` imports it without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge.config_base import ranged, require

BUILTIN_TOOLS = ("python",)


SERVER_KEYS = ("url", "app", "command")  # env.openenv's keys that name a server: at most one is set


@dataclass(kw_only=True)
class OpenEnvConfig:
    """An OpenEnv server as the environment (forge/env/openenv.py): one WebSocket session per episode."""

    url: str = ""
    """URL 'http://host:port' of a running OpenEnv server: one WebSocket session (its /ws) per episode."""
    app: str = ""
    """Import path 'pkg.mod:app' of an OpenEnv server's ASGI app that forgeweave serves (uvicorn) on 127.0.0.1 for
    the run, on a free port, and stops at its end."""
    command: str = ""
    """Command line that starts an OpenEnv server on 127.0.0.1 port {port} (forgeweave picks a free one and fills it
    in); started for the run and stopped by its PID at the end."""
    text_action: str = ""
    """Name of the field of an OpenEnv server's own action that takes text (e.g. 'message'): the policy answers the
    server with its plain replies, no tool calls (no tools are offered); each reply is one step {field: reply}, the
    observation's text comes back as a user turn, and the server's done ends the episode. Empty = tool calls only."""
    max_sessions: int = ranged(0, ">= 0", "(0 = as many as the server accepts, found at start)")
    """OpenEnv sessions (episodes) open at once; keep it <= the server's max_concurrent_envs."""
    timeout_s: float = ranged(30.0, "> 0", "seconds")
    """Seconds to connect to the OpenEnv server and for each reset / close answer (tool calls: env.tool_timeout_s)."""
    start_timeout_s: float = ranged(60.0, "> 0", "seconds")
    """Seconds a server forgeweave starts (app, command) may take to answer /health."""

    @property
    def servers(self) -> list[str]:
        """The keys of this section that name a server, in SERVER_KEYS order (at most one in a checked config)."""
        return [k for k in SERVER_KEYS if getattr(self, k)]

    def check(self, prefix: str) -> None:
        servers = [f"{prefix}{k}" for k in self.servers]
        if len(servers) > 1:
            require(False, servers[1], f"and {servers[0]} both name an OpenEnv server: keep one")
        url = self.url
        require(not url or url.startswith(("http://", "https://")), f"{prefix}url",
                f"must start with http:// or https://, got {url!r}")  # fmt: skip
        app = self.app
        require(not app or (":" in app and all(app.partition(":")[::2])), f"{prefix}app",
                f"must look like 'pkg.module:app', got {app!r}")  # fmt: skip
        require(not self.text_action or bool(servers), f"{prefix}text_action", "applies to an OpenEnv server: set "
                f"{prefix}url, {prefix}app or {prefix}command, or clear it")  # fmt: skip
        why = "must contain {port} (where the server's port goes): forgeweave picks a free port on 127.0.0.1"
        require(not self.command or "{port}" in self.command, f"{prefix}command", why)


@dataclass(kw_only=True)
class AgentConfig:
    """An agent written against the OpenAI API as the environment (forge/env/agent.py)."""

    fn: str = ""
    """Import path 'pkg.mod:fn' of an agent written against the OpenAI API, `fn(base_url: str, row: dict) -> float |
    None` (sync or async): each episode runs it in a thread of its own with a base URL of its own on the
    OpenAI-compatible endpoint forgeweave serves from the policy on 127.0.0.1 (forge/env/agent.py); its return value
    is the episode's reward (None: the verifiers score the final reply). Empty = none."""
    command: str = ""
    """An agent that is a program, run once per episode (forge/env/agent_command.py): `OPENAI_BASE_URL` (the
    episode's base URL) and `OPENAI_API_KEY` in its environment, the data row as JSON on stdin; its reward is the last
    line of its stdout (a number; nothing or `none`: the verifiers score the final reply). Empty = none."""
    timeout_s: float = ranged(120.0, "> 0", "seconds")
    """Seconds an agent's episode may run; past it the episode fails (one line, out of the loss), the run goes on."""
    max_concurrent: int = ranged(0, ">= 0", "(0 = every episode of the call at once)")
    """Agent episodes running at once; the next starts when one ends."""
    batch_wait_ms: float = ranged(5.0, ">= 0", "milliseconds")
    """How long the endpoint holds a request for others to join its batch (it samples at once when every running
    episode has a request waiting). Short by default: where the agents' own work spreads their requests (an SDK agent
    on the tiny preset), 50 ms made fewer, larger batches and no faster step (docs/agents.md, Batching)."""
    request_sampling: bool = False
    """Honour a request's `temperature` and `top_p`. False (default): every request samples at the step's
    (rollout.temperature in training), the distribution the trainer's log-probs assume; the request's are ignored."""

    @property
    def key(self) -> str:
        """The key that gives the agent ('' = none)."""
        return "env.agent.fn" if self.fn else "env.agent.command" if self.command else ""

    def check(self, prefix: str) -> None:
        fn = self.fn
        require(not fn or (":" in fn and all(fn.partition(":")[::2])), f"{prefix}fn",
                f"must look like 'pkg.module:function', got {fn!r}")  # fmt: skip
        require(not (fn and self.command), f"{prefix}command", f"and {prefix}fn both give the agent: keep one")
        require(not self.command or _splits(self.command), f"{prefix}command",
                f"cannot be split into a program and its arguments: {self.command!r}")  # fmt: skip


@dataclass(kw_only=True)
class EnvConfig:
    environment_factory: str = ""
    """Import path 'pkg.mod:Class' of a TRL-style environment class (no-argument constructor, reset(**row), every
    public method a tool; docs/environments.md); empty = none."""
    tools: list[str] = field(default_factory=list)
    """Import paths 'pkg.mod:fn' of stateless tool functions (typed arguments and a docstring with an Args section)."""
    builtin_tools: list[Literal["python"]] = field(default_factory=list)
    """Built-in tools: `python` runs the model's code in the code_exec sandbox (reward.code_exec's limits)."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """openenv: an OpenEnv server as the environment (a running one, or one forgeweave starts) and its limits."""
    max_turns: int = ranged(4, ">= 1")
    """Policy turns per episode; an episode still calling tools after this many is cut (truncated)."""
    max_tokens: int = ranged(0, ">= 0", "(0 = 4 x rollout.max_new_tokens)")
    """Token budget of an episode after its prompt, sampled and tool tokens together (0 = 4 x rollout.max_new_tokens);
    an episode that reaches it is cut (truncated)."""
    tool_timeout_s: float = ranged(10.0, ">= 0", "seconds (0 = no limit)")
    """Seconds one tool call may take; past it the model gets an error message as the tool's answer (the call's thread
    runs on: after forge.env.tools.MAX_STUCK_TOOLS such calls, an episode that calls a tool fails instead)."""
    max_tool_calls_per_turn: int = ranged(16, ">= 1")
    """Tool calls answered per policy turn; the turn's further calls are not run and get one error answer."""
    episode_timeout_s: float = ranged(0.0, ">= 0", "seconds (0 = no limit)")
    """Wall-clock seconds an episode may run (sampling and tools); one past it is cut after its current turn."""
    mask_truncated: bool = True
    """Take episodes cut by a limit out of the loss (their loss mask is 0); they are still counted (env/truncated)."""
    cut_reply: Literal["end", "continue"] = "end"
    """A policy turn cut by rollout.max_new_tokens (counted: env/cut_frac): 'end' ends the episode there (finish
    reason length, as single-turn and TRL); 'continue' reads it as a reply: its tool calls are answered, or it goes
    to on_reply (or an OpenEnv text action), and the episode goes on."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    """agent: an agent written against the OpenAI API as the environment, and its endpoint's limits."""

    @property
    def server_key(self) -> str:
        """The key that names this run's OpenEnv server ('' = none)."""
        return next((f"env.openenv.{k}" for k in self.openenv.servers), "")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn episodes (an environment, an OpenEnv server or tools are configured)."""
        return bool(self.environment_factory or self.tools or self.builtin_tools or self.server_key or self.agent.key)

    @property
    def source_key(self) -> str:
        """The key that makes the rollouts episodes (for errors about where they can run)."""
        if self.environment_factory:
            return "env.environment_factory"
        if self.agent.key:
            return self.agent.key
        return self.server_key or ("env.tools" if self.tools else "env.builtin_tools")

    def check(self, prefix: str) -> None:
        twice = len(set(self.tools)) != len(self.tools)
        require(not twice, f"{prefix}tools", "lists a tool twice: list it once")
        unknown = [n for n in self.builtin_tools if n not in BUILTIN_TOOLS]
        require(not unknown, f"{prefix}builtin_tools", f"has {unknown}: the built-in tools are {list(BUILTIN_TOOLS)}")
        require(len(set(self.builtin_tools)) == len(self.builtin_tools), f"{prefix}builtin_tools",
                "lists a tool twice: list it once")  # fmt: skip
        servers = [f"{prefix}openenv.{k}" for k in self.openenv.servers]
        if servers and self.environment_factory:
            why = f"and {servers[0]} both give the environment: keep one (an empty value clears a preset's)"
            require(False, f"{prefix}environment_factory", why)
        others = [f"{prefix}{k}" for k in ("environment_factory", "tools", "builtin_tools") if getattr(self, k)]
        others += servers
        agent = self.agent.key.removeprefix("env.")
        require(not agent or not others, f"{prefix}{agent}", f"and {others[0] if others else ''} both give "
                "the environment: an agent brings its own tools; keep one")  # fmt: skip


def _splits(command: str) -> bool:
    """Whether `command` splits (as a shell would) into at least a program."""
    import shlex

    try:
        return bool(shlex.split(command))
    except ValueError:  # an unclosed quote
        return False
