"""Built-in tools (`env.builtin_tools`).

`python`: runs the code the model passes in the `code_exec` sandbox (forge/rewards/code_exec.py: namespaces, a
read-only filesystem, no network, rlimits) under `reward.code_exec`'s limits (timeout_s for the run, test_timeout_s
for the program itself, memory_mb, max_procs) and answers with what it printed (stdout and stderr together, at
most 8 KiB). A program that raises, or runs past a limit, is answered with its output and an error line, counted as
a tool error (`forge.env.tools.ToolError`); the episode goes on. A machine where no sandbox can be built refuses the
tool at start, as the code_exec verifier does, unless reward.code_exec.allow_network is set.
"""

from __future__ import annotations

from forge.env.tools import Tool, ToolError, tool_of

OUTPUT_KB = 8  # KiB of printed output the model gets back


def builtin_tools(names: list[str], code_exec) -> list[Tool]:
    """The built-in tools `names` (env.builtin_tools); `code_exec`: the sandbox limits (`CodeExecConfig`)."""
    return [python_tool(code_exec) for name in names if name == "python"]


def python_tool(code_exec) -> Tool:
    """The `python` tool with the sandbox limits of `code_exec` (`CodeExecConfig`), checked now."""
    from forge.rewards.code_exec import limits_from, require_isolation, run_program

    limits, mode = limits_from(code_exec), require_isolation(code_exec.allow_network)

    def python(code: str) -> str:
        """Run a Python program in a sandbox (no network, no files kept) and return what it printed.

        Args:
            code: the Python program; print what you want to see
        """
        result = run_program(code, limits, mode, OUTPUT_KB)
        return answer(result.status, result.detail, result.output, limits.per_test_s)

    return tool_of(python)


def answer(status: str, detail: str, output: str, limit_s: float) -> str:
    """The tool's answer for a run that ended with `status`: its output, or a ToolError with the output and why.

    >>> answer("ok", "", "7\\n", 2.0)
    '7\\n'
    >>> answer("load_error", "ZeroDivisionError: division by zero", "", 2.0)
    Traceback (most recent call last):
    forge.env.tools.ToolError: Error: ZeroDivisionError: division by zero
    """
    if status == "ok":
        return output or "(no output)"
    if status == "load_error" and detail.startswith("_TestTimeout"):
        why = f"the program ran past its {limit_s:g} s limit"
    elif status == "load_error":
        why = detail
    elif status == "timeout":
        why = "the program ran past the sandbox's time limit and was killed"
    elif status == "forged":
        why = "the program wrote on the sandbox's own result channel"
    elif status == "setup_failed":
        why = f"the sandbox could not start ({detail[:200]})"
    else:
        why = "the program crashed (a memory or process limit, or a signal)"
    raise ToolError("\n".join(x for x in (output.rstrip("\n"), f"Error: {why}") if x))
