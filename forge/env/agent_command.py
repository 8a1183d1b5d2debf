"""An agent that is a program (`env.agent.command`): run once per episode, the episode's endpoint in its environment.

The command (split like a shell would, no shell run) starts in a session of its own with `OPENAI_BASE_URL` (the
episode's base URL on forgeweave's OpenAI-compatible endpoint, forge/env/agent.py) and `OPENAI_API_KEY` (not checked;
clients want one) in its environment, and the episode's data row as one JSON object on stdin. Its reward is the last
line of its stdout: a number, or nothing / `none` / `null` for the verifiers to score the transcript. Any agent, in any
language, whose OpenAI client reads those two variables (the official SDKs, LangChain, the Agents SDK) trains
unchanged.

What it gets and what it does not: the run's environment minus forgeweave's and the stack's secrets (names holding
PASSWORD, SECRET, TOKEN or AUTH_STRING, and PGPASSFILE: an agent is not trusted with them, docs/hardening.md). A
program that exits non-zero, prints something else last, or runs past `env.agent.timeout_s` fails its episode with
one line (its process group is killed: nothing it started outlives the episode); the run goes on.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Callable

WITHHELD = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH_STRING|^PGPASSFILE$")  # environment names an agent never sees
NO_REWARD = {"", "none", "null"}  # a last line that leaves the episode to the verifiers


class AgentCommandError(RuntimeError):
    """The program failed its episode (exit code, timeout, a last line that is not a reward)."""


def command_agent(command: str, timeout_s: float) -> Callable[[str, dict], float | None]:
    """`env.agent.command` as an agent function of (base_url, row) for forge.env.agent.AgentHost."""
    argv = shlex.split(command)

    def agent(base_url: str, row: dict) -> float | None:
        env = {k: v for k, v in os.environ.items() if not WITHHELD.search(k)}
        env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY="forgeweave")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, start_new_session=True)  # fmt: skip
        except OSError as e:
            raise AgentCommandError(f"cannot start it ({e.strerror or e})") from None
        try:
            out, err = proc.communicate(json.dumps(row, default=str), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AgentCommandError(f"did not exit within env.agent.timeout_s={timeout_s:g} s") from None
        finally:
            _kill_group(proc)
        if proc.returncode:
            last = (err.strip().splitlines() or [""])[-1][:200]
            raise AgentCommandError(f"exited with code {proc.returncode}" + (f": {last}" if last else ""))
        return reward_line(out)

    agent.__qualname__ = f"command {argv[0] if argv else command!r}"
    return agent


def reward_line(stdout: str) -> float | None:
    """The reward a program printed as its last line (None: it left the episode to the verifiers).

    >>> reward_line("thinking...\\n0.75\\n"), reward_line("\\n"), reward_line("None")
    (0.75, None, None)
    >>> reward_line("the answer is 7")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge.env.agent_command.AgentCommandError: printed 'the answer is 7' as its last line: print the reward ...
    """
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if last.lower() in NO_REWARD:
        return None
    try:
        value = float(last)
    except ValueError:
        why = f"printed {last[:80]!r} as its last line: print the reward (a number) or nothing"
        raise AgentCommandError(why) from None
    if not math.isfinite(value):
        raise AgentCommandError(f"printed {last[:80]!r} as its reward: a finite number, please")
    return value


def _kill_group(proc: subprocess.Popen) -> None:
    """End what the program left running (its session's process group) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
