"""A multi-turn run's environment, from its sections: the factory (a TRL-style class, an OpenEnv server's client or an
agent's endpoint), the stateless and built-in tools, and the chat format; `close_environment` releases what was
started. Above `forge.env.episode` (which plays episodes) and `forge.env.agent` (which serves an agent)."""

from __future__ import annotations

from collections.abc import Callable

from forge.env.agent import AgentHost, load_agent
from forge.env.agent_command import command_agent
from forge.env.builtin import builtin_tools
from forge.env.chat import ChatFormat
from forge.env.config import EnvConfig
from forge.env.openenv import OpenEnvClient, connect
from forge.env.tools import Tool, check_environment, load_object, tool_of
from forge.model_config import ModelConfig
from forge.rewards.code_exec import CodeExecConfig


def load_environment(e: EnvConfig, model: ModelConfig, code_exec: CodeExecConfig, episodes: int,
                     tok) -> tuple[Callable | None, list[Tool], ChatFormat]:  # fmt: skip
    """(the environment factory, the stateless and built-in tools, the chat format: `model`'s chat template and
    system prompt) of the `env` section; `code_exec`: the sandbox of the built-in python tool; `episodes`: a step's
    (B * G, the sessions an OpenEnv server must hold), checked once at start: a class without reset, a tool without
    a docstring, an OpenEnv server that does not answer is a one-line UserError naming it. An OpenEnv server named by
    env.openenv.app / env.openenv.command is started here, as is the endpoint of an agent (env.agent.fn or
    env.agent.command); `close_environment` stops them."""
    use_template = model.chat_template if model.chat_template is not None else True
    if e.agent.key:  # the endpoint starts here (127.0.0.1, a free port); close_environment stops it
        agent = load_agent(e.agent.fn) if e.agent.fn else command_agent(e.agent.command, e.agent.timeout_s)
        return AgentHost(agent, tok, e, model.path, use_template), [], ChatFormat(tok, use_template)
    factory = load_object(e.environment_factory, "env.environment_factory") if e.environment_factory else None
    if factory is not None:
        check_environment(factory)
    functions = [tool_of(load_object(spec, "env.tools")) for spec in e.tools]
    functions += builtin_tools(e.builtin_tools, code_exec)
    if e.server_key:
        factory = connect(e, episodes)
    return factory, functions, ChatFormat(tok, use_template, model.system_prompt)


def close_environment(env: tuple) -> None:
    """Release what `load_environment` started (an OpenEnv server forgeweave runs, an agent's endpoint); idempotent."""
    factory = env[0]
    if isinstance(factory, OpenEnvClient | AgentHost):
        factory.close()
