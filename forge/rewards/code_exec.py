r"""`code_exec`: run each completion's Python code against hidden tests in a sandboxed process; score = share passed.

The answer column holds the hidden tests as JSON, in one of these forms:

- a list of tests: `["assert f(2) == 5", "assert f(-1) == 2"]`;
- an object `{"tests": [...], "prefix": "def f(x):\n    return "}`: `prefix` is code the completion continues
  (HumanEval style: the prompt shows the signature and the completion is the body); `"suffix"` makes it
  fill-in-the-middle; `"trusted": true` allows free-form tests (below);
- `{"entry": "f", "cases": [[[2], 5], [[-1], 2]]}`: each case is the test `assert f(*args) == expected`.

The program (`program_for`) is the completion's first fenced ```python (or ```py or bare ```) block, else the
completion itself; with a `prefix`, prefix + the completion as it stands (it continues the code). Either is cut
after its longest run of leading lines that parses, so text after the code, or a last line cut off by the token
limit, is dropped. With a `suffix` too, prefix + completion + suffix, uncut (fill-in-the-middle). Each distinct
(program, tests) pair runs once, in its own process, at most `workers` at a time; the verifier remembers the
scores of the last 100k pairs it ran, so a program sampled again is not run again (one whose result depends on
randomness or time keeps its first score).

Judging happens here, not in the sandbox (forge/rewards/code_judge.py): the program shares its interpreter with
the code that runs the tests, so it could forge anything judged there (an `__eq__` that always says yes, patched
builtins, result lines written by hand). Each `assert <expr> == <literal>` is sent as `<expr>` alone; the sandbox
sends back the value as JSON of exact built-in types (anything else is no value and fails), and it is compared
here, as Python compares built-in values, with the expected literal, which never leaves this process. `assert <a> == <b>` with no
literal side has both values sent back (the program can see those: weaker). Free-form tests (`assert
is_sorted(f(x))`, a statement) run in the sandbox as before, only in a suite marked `"trusted": true`; in an
untrusted one they make the row a data error. The result lines must come in one exact order; any line out of it
(the program wrote on the results fd) scores the run 0. A test passes when its value matches (a free-form one:
when it raises nothing), each with its own time limit. The score is passed / total; 0.0 when the program fails
to load, hangs, or breaks a limit (it keeps the tests passed before); None when the answer is not a valid test
spec (a data error: NaN in the scores, counted in `reward/code_exec/failures`).

What this still trusts: that the expected values cannot be read from inside the sandbox some other way (it sees
/usr and the Python installation, nothing else of the machine: hidden tests in a readable file there, e.g. forge's
shipped tasks when forge is installed into the base interpreter rather than a venv or checkout, could be echoed); the values of pair checks and the verdicts of free-form tests in trusted suites, which
come from the program's own interpreter; in mode "none" (no namespaces), that the program does not read forge's
memory (it runs as the same user). `code_judge.suspicious` counts completions that reach for these tricks.

Isolation (docs/code-exec.md has the threat model): new network (no interfaces but a down loopback), mount,
PID, IPC and UTS namespaces; a fresh root that holds only read-only binds of the system's programs and libraries and
the Python installation, a private size-capped tmpfs on /tmp that is the working directory, and a /proc of its own
(no home, /run, socket or checkout is there to read); a fresh unprivileged uid with no groups (or, where we are not
root, a nested user namespace in which the code is nobody); no_new_privs; rlimits on CPU
seconds, address space, file size, processes, open files; an empty environment; stdout/stderr to a capped file; a
wall-clock timeout after which the whole process group is killed, and the PID namespace takes every process the
program started with it. Where no namespace can be created the verifier refuses to start unless
`reward.code_exec.allow_network` is set (then only rlimits, a temp dir and the timeout apply).
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from forge.errors import UserError
from forge.rewards.code_judge import Check, checks_for, same

Isolation = Literal["root", "userns", "none"]
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_UID_BASE = 1_900_000_000  # sandbox uids: no account uses them; one per concurrent slot so RLIMIT_NPROC is per run
_RESULT_CAP = 8 << 20  # bytes of result lines read back (values of up to 1 MiB each); a flood gets nothing more
_ERR_CAP = 1 << 16  # bytes of the runner's stderr read back
_MAX_TESTS = 1000
_MEMO_SIZE = 100_000  # (program, tests) scores kept per verifier; cleared when full


@dataclass(kw_only=True)
class CodeExecConfig:
    """`reward.code_exec`: the sandbox limits of the code_exec verifier (checked when it is built: `limits_from`)."""

    timeout_s: float = 5.0
    """Wall-clock seconds per completion (program + all its tests); then its processes are killed."""
    test_timeout_s: float = 2.0
    """Wall-clock seconds for loading the program and for each test."""
    memory_mb: int = 256
    """Address-space limit of each sandboxed process (RLIMIT_AS); a run holds at most max_procs."""
    max_procs: int = 8
    """Processes and threads the sandboxed code may have at once (RLIMIT_NPROC of its own uid)."""
    workers: int = 2
    """Completions run at once (one process each)."""
    allow_network: bool = False
    """Where no network namespace can be made, run code anyway (it could reach the network)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits (from `CodeExecConfig`)."""

    timeout_s: float = 5.0  # wall clock for the whole run; then the process group and PID namespace are killed
    per_test_s: float = 2.0  # wall clock per test (and for loading the program)
    memory_mb: int = 256  # RLIMIT_AS, per process
    max_procs: int = 8  # RLIMIT_NPROC (processes and threads of the sandbox uid)
    file_kb: int = 1024  # RLIMIT_FSIZE; also caps the captured stdout/stderr
    tmpfs_kb: int = 8192  # size of the private /tmp
    workers: int = 2  # runs at once


@dataclass(frozen=True)
class CodeTests:
    """Hidden tests parsed from the answer column."""

    tests: tuple[str, ...]
    prefix: str = ""
    suffix: str = ""  # fill-in-the-middle: the program is prefix + completion + suffix
    trusted: bool = False  # free-form tests allowed: judged inside the program's interpreter (forgeable)


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run gave."""

    passed: int
    total: int
    status: Literal["ok", "load_error", "timeout", "crashed", "setup_failed", "forged"]
    detail: str = ""  # load error type, or the runner's stderr when setup failed
    # forged: the result lines broke the protocol (a line out of order, repeated or unknown): nothing passed
    output: str = ""  # what the program printed (stdout and stderr), when the request asked for it (`run_program`)

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(completion: str) -> str:
    r"""The first fenced python block, else the completion itself.

    >>> extract_code("Here:\n```python\ndef f(x):\n    return x\n```\nDone.")
    'def f(x):\n    return x\n'
    >>> extract_code("return x + 1")
    'return x + 1'
    """
    found = _FENCE.search(completion)
    return found.group(1) if found else completion


def program_for(completion: str, spec: CodeTests) -> str:
    r"""The program to run: spec.prefix + the completion's code, cut after its longest run of leading lines that
    parses (what a model adds after its code, or a line cut off by the token limit, is dropped). Without a prefix
    the code is `extract_code(completion)`; with one the completion continues the prefix as it stands.

    >>> program_for(" x + 1\n\nprint(f(2)) and more tex", CodeTests(("assert f(1) == 2",), "def f(x):\n    return"))
    'def f(x):\n    return x + 1\n\n'
    """
    if spec.suffix:
        return spec.prefix + completion + spec.suffix
    if not spec.prefix:
        completion = extract_code(completion)
    lines = completion.splitlines(keepends=True)
    for end in range(len(lines), 0, -1):
        program = spec.prefix + "".join(lines[:end])
        if _compiles(program):
            return program
    return spec.prefix + completion


def parse_tests(answer: Any) -> CodeTests | None:
    """A CodeTests from the answer column's JSON (see the module docstring), or None when it is not one; a
    free-form test (not `assert <expr> == <expr>`) in a suite without `"trusted": true` is not one either.

    >>> parse_tests('{"tests": ["assert f(1) == 2"], "trusted": true}').trusted, parse_tests('["assert f(1)"]')
    (True, None)
    """
    try:
        spec = json.loads(answer) if isinstance(answer, str) else answer
    except ValueError:
        return None
    if isinstance(spec, list):
        spec = {"tests": spec}
    if not isinstance(spec, dict):
        return None
    prefix, suffix, trusted = spec.get("prefix", ""), spec.get("suffix", ""), spec.get("trusted", False)
    tests = spec.get("tests", [])
    if "cases" in spec:
        tests = _case_tests(spec.get("entry"), spec["cases"])
    ok = isinstance(prefix, str) and isinstance(suffix, str) and isinstance(trusted, bool)
    if not (ok and isinstance(tests, list) and 0 < len(tests) <= _MAX_TESTS and all(isinstance(t, str) for t in tests)):
        return None
    found = CodeTests(tuple(tests), prefix, suffix, trusted)
    return found if checks_for(found.tests, found.trusted) is not None else None


def _case_tests(entry: Any, cases: Any) -> Any:
    """`assert entry(*args) == expected` per case; repr, not JSON, so true/false/null are Python's literals."""
    if not (isinstance(entry, str) and entry.isidentifier() and isinstance(cases, list)):
        return None
    if not all(isinstance(c, list) and len(c) == 2 and isinstance(c[0], list) for c in cases):
        return None
    return [f"assert {entry}(*{args!r}) == {want!r}" for args, want in cases]


@functools.cache
def probe_isolation() -> Isolation:
    """The strongest isolation this machine allows: 'root' (namespaces + a fresh uid), 'userns' (namespaces inside
    an unprivileged user namespace) or 'none'. Tries each for real once per process."""
    modes: list[Isolation] = ["root", "userns"] if os.geteuid() == 0 else ["userns"]
    for mode in modes:
        req = {"probe": True, "program": "", "checks": [], "per_test_s": 1.0}
        result = _run_request(mode, req, SandboxLimits(), slot=0)
        if result.status == "ok":
            return mode
    return "none"


def require_isolation(allow_network: bool) -> Isolation:
    """The isolation to use; a UserError when there is none and running code with network was not allowed."""
    mode = probe_isolation()
    if mode == "none" and not allow_network:
        raise UserError(
            "code_exec: this machine cannot create a network namespace, so sandboxed code could reach the network; "
            "run where user or network namespaces are allowed, or pass --allow-network-code "
            "(reward.code_exec.allow_network=true) to accept that"
        )
    return mode


def run_sandboxed(program: str, spec: CodeTests, limits: SandboxLimits, mode: Isolation, slot: int = 0) -> RunResult:
    """Run `program` (the whole program: see `program_for`) in a fresh sandboxed process, evaluate each of
    spec.tests' checks there and judge the values here (forge/rewards/code_judge.py). Never raises for bad code:
    whatever the program does shows in the RunResult. A ValueError for a spec `parse_tests` would refuse."""
    checks = checks_for(spec.tests, spec.trusted)
    if checks is None:
        raise ValueError("code_exec: free-form tests (not `assert <expr> == <expr>`) need a suite marked trusted")
    req = {"program": program, "checks": [c.request() for c in checks], "per_test_s": limits.per_test_s}
    return _run_request(mode, req, limits, slot, checks)


def run_program(program: str, limits: SandboxLimits, mode: Isolation, output_kb: int = 8) -> RunResult:
    """Run `program` alone (no tests) in a fresh sandboxed process and read back its first `output_kb` KiB of
    printed output (the `python` tool, forge/env/builtin.py). Never raises for bad code."""
    req = {"program": program, "checks": [], "per_test_s": limits.per_test_s, "output_kb": output_kb}
    return _run_request(mode, req, limits, slot=limits.workers)  # a slot (uid) of its own beside code_exec's


def limits_from(cfg: CodeExecConfig) -> SandboxLimits:
    """SandboxLimits from reward.code_exec (a UserError naming the key when one is out of range)."""
    for key, value in (("timeout_s", cfg.timeout_s), ("test_timeout_s", cfg.test_timeout_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= 3600):
            why = f"must be a number of seconds in (0, 3600], got {value!r}"
            raise UserError(f"config key 'reward.code_exec.{key}' {why}")
    for key, value, lo, hi in (("memory_mb", cfg.memory_mb, 64, 1 << 20),
                               ("max_procs", cfg.max_procs, 1, 4096),
                               ("workers", cfg.workers, 1, 64)):  # fmt: skip
        if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
            raise UserError(f"config key 'reward.code_exec.{key}' must be an integer in [{lo}, {hi}], got {value!r}")
    return SandboxLimits(
        timeout_s=float(cfg.timeout_s),
        per_test_s=min(float(cfg.test_timeout_s), float(cfg.timeout_s)),
        memory_mb=cfg.memory_mb,
        max_procs=cfg.max_procs,
        workers=cfg.workers,
    )


def make_code_exec(limits: SandboxLimits, allow_network: bool = False):
    """The `code_exec` verifier with these limits; refuses (UserError) now if no sandbox can be built here."""
    mode = require_isolation(allow_network)
    memo: dict[tuple[str, CodeTests], float] = {}  # programs seen in earlier batches (RL resamples the same ones)

    def code_exec(prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any) -> list[float | None]:
        """Share of the hidden tests (answer column, JSON) the completion's code passes, run in a sandbox."""
        specs = [parse_tests(a) for a in answer]
        programs = [None if s is None else program_for(c, s) for c, s in zip(completions, specs, strict=True)]
        jobs = {(p, s) for p, s in zip(programs, specs, strict=True) if s is not None}  # duplicates run once
        runnable = [(p, s) for p, s in jobs if (p, s) not in memo and _compiles(p)]
        scores = {job: memo.get(job, 0.0) for job in jobs} | _run_all(sorted(runnable, key=repr), limits, mode)
        if len(memo) > _MEMO_SIZE:
            memo.clear()
        memo.update(scores)
        return [None if s is None else scores[(p, s)] for p, s in zip(programs, specs, strict=True)]

    from forge.rewards.verifiers import takes_text

    return takes_text(code_exec)


def _compiles(program: str) -> bool:
    """Whether the program parses. compile() runs nothing (constant folding is size-capped), so a program that
    does not parse scores 0 here exactly as it would in the sandbox, without starting a process."""
    try:
        compile(program, "<completion>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


def _run_all(jobs: Sequence[tuple[str, CodeTests]], limits: SandboxLimits, mode: Isolation) -> dict:
    slots: queue.Queue[int] = queue.Queue()
    for i in range(limits.workers):
        slots.put(i)

    def one(job: tuple[str, CodeTests]) -> float:
        slot = slots.get()
        try:
            result = run_sandboxed(job[0], job[1], limits, mode, slot)
        finally:
            slots.put(slot)
        if result.status == "setup_failed":  # our fault, not the program's: no score rather than a wrong 0
            raise RuntimeError(f"code_exec sandbox could not start: {result.detail}")
        return result.score

    with ThreadPoolExecutor(max_workers=max(1, limits.workers), thread_name_prefix="code_exec") as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


def _slot_uid(slot: int) -> int:
    # distinct per forge process and slot, so two runs never share an RLIMIT_NPROC count
    return _UID_BASE + (os.getpid() % 100_000) * 64 + slot


def _run_request(
    mode: Isolation, req: dict, limits: SandboxLimits, slot: int, checks: Sequence[Check] = ()
) -> RunResult:
    """Run the request in a sandbox and read its result lines against `checks` (whose expected values stay here)."""
    uid = _slot_uid(slot)
    req = {
        **req,
        "mode": mode,
        "uid": uid,
        "gid": uid,
        "cpu_s": max(1, math.ceil(limits.timeout_s)),
        "memory_mb": limits.memory_mb,
        "max_procs": limits.max_procs,
        "file_kb": limits.file_kb,
        "tmpfs_kb": limits.tmpfs_kb,
    }
    workdir = tempfile.mkdtemp(prefix="forge-code-") if mode == "none" else ""
    req["workdir"] = workdir
    try:
        return _spawn(req, limits.timeout_s, checks)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _spawn(req: dict, timeout_s: float, checks: Sequence[Check]) -> RunResult:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-B", str(_RUNNER), str(timeout_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={},
        cwd="/",
        start_new_session=True,  # its own process group, killed as a whole
        close_fds=True,
    )
    try:
        proc.stdin.write(json.dumps(req).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out, err, timed_out = _read_until(proc, time.monotonic() + timeout_s)
    _kill_group(proc)
    return _parse(req, checks, out, err, timed_out, proc.returncode)


def _read_until(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes, bool]:
    """stdout and stderr (each capped) until both close or the deadline passes."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    caps = {proc.stdout: _RESULT_CAP, proc.stderr: _ERR_CAP}
    with selectors.DefaultSelector() as sel:
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), True
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif len(bufs[key.fileobj]) < caps[key.fileobj]:
                    bufs[key.fileobj] += chunk[: caps[key.fileobj] - len(bufs[key.fileobj])]
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), True
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), False


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the runner's process group (the PID namespace's init dies with it, and the namespace with that)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        f.close()


def _parse(req: dict, checks: Sequence[Check], out: bytes, err: bytes, timed_out: bool, returncode: int) -> RunResult:
    if req.get("probe"):
        ok = out.startswith(b"ok\n") and returncode == 0
        return RunResult(0, 0, "ok" if ok else "setup_failed", err.decode(errors="replace").strip())
    lines = out.decode("ascii", errors="replace").split("\n")[:-1]  # whole lines: a capped last one is dropped
    if lines[:1] != ["ready"]:  # the program never ran: the sandbox failed to start, or died setting up
        setup = returncode == 3 or b"sandbox setup failed" in err
        detail = err.decode(errors="replace").strip()[-500:]
        return RunResult(0, len(checks), "setup_failed" if setup else "timeout" if timed_out else "crashed", detail)
    passed, status, detail, output = read_results(lines[1:], checks, bool(req.get("output_kb")))
    if status == "crashed" and timed_out:
        status = "timeout"
    return RunResult(passed, len(checks), status, detail, output)


def read_results(lines: list[str], checks: Sequence[Check], want_output: bool = False) -> tuple[int, str, str, str]:
    """(checks passed, status, load error, printed output) from the runner's result lines after "ready", which must
    come in exactly this order: "loaded", "<i> <value>" for i = 0, 1, ... (judged by `same` as they come), "done",
    with `want_output` an "output <hex>" last; or "load <error>" (then the output). A run cut short (timeout, exit,
    crash) keeps the checks judged so far; any line out of this order (repeated, extra, unknown: the program wrote
    on the results fd) makes the whole run 'forged', with nothing passed.

    >>> from forge.rewards.code_judge import checks_for
    >>> two = checks_for(("assert f(1) == 2", "assert f(2) == 4"))
    >>> read_results(["loaded", "0 2", "1 5", "done"], two), read_results(["loaded", "0 2"], two)[:2]
    ((1, 'ok', '', ''), (1, 'crashed'))
    >>> read_results(["loaded", "0 2", "1 4", "done", "1 4"], two)[:2], read_results(["0 2", "loaded"], two)[:2]
    ((0, 'forged'), (0, 'forged'))
    """
    passed, status, detail, output, at = 0, "crashed", "", "", 0
    if lines[:1] == ["loaded"]:
        at = 1
        while at <= len(checks) and at < len(lines) and lines[at].startswith(f"{at - 1} "):
            passed += same(checks[at - 1], lines[at][len(f"{at - 1} ") :])
            at += 1
        if at == len(checks) + 1 and lines[at : at + 1] == ["done"]:
            status, at = "ok", at + 1
    elif lines[:1] and lines[0].startswith("load "):
        status, detail, at = "load_error", lines[0][len("load ") :], 1
    if want_output and lines[at : at + 1] and lines[at].startswith("output "):
        output, at = _hex_text(lines[at][len("output ") :]), at + 1
    if at != len(lines):
        return 0, "forged", "", ""
    return passed, status, detail, output


def _hex_text(hex_text: str) -> str:
    try:
        return bytes.fromhex(hex_text).decode(errors="replace")
    except ValueError:
        return ""
