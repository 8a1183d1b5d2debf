r"""`code_exec`: run each completion's Python code against hidden tests in a sandboxed process; score = share passed.

The answer column holds the hidden tests as JSON, in one of two forms:

- a list of statements, each a test: `["assert f(2) == 5", "assert f(-1) == 2"]` (a test passes when it runs
  without raising);
- an object `{"tests": [...statements...], "prefix": "def f(x):\n    return "}`: `prefix` is code the completion
  continues (HumanEval style: the prompt shows the signature and the completion is the body), or
  `{"entry": "f", "cases": [[[2], 5], [[-1], 2]]}`: each case passes when `f(*args) == expected`.

The program (`program_for`) is the completion's first fenced ```python (or ```py or bare ```) block, else the
completion itself; with a `prefix`, prefix + the completion as it stands (it continues the code). Either is cut
after its longest run of leading lines that parses, so text after the code, or a last line cut off by the token
limit, is dropped. With a `suffix` too, prefix + completion + suffix, uncut (fill-in-the-middle). Each distinct
(program, tests) pair runs once, in its own process, at most `workers` at a time; the verifier remembers the
scores of the last 100k pairs it ran, so a program sampled again is not run again (one whose result depends on
randomness or time keeps its first score). Inside, one test at a time with its own time limit; a test passes when it raises nothing. The
score is passed / total; 0.0 when the program fails to load, hangs, or breaks a limit; None when the answer is
not a valid test spec (a data error: NaN in the scores, counted in `reward/code_exec/failures`).

Isolation (docs/code-exec.md has the threat model): new network (no interfaces but a down loopback), mount,
PID, IPC and UTS namespaces; every mount read-only except a private size-capped tmpfs on /tmp that is the working
directory; a fresh unprivileged uid (or a nested user namespace where we are not root); no_new_privs; rlimits on CPU
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
import secrets
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

Isolation = Literal["root", "userns", "none"]
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_UID_BASE = 1_900_000_000  # sandbox uids: no account uses them; one per concurrent slot so RLIMIT_NPROC is per run
_RESULT_CAP = 1 << 16  # bytes of result lines read back; a program flooding the results fd gets nothing more
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


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run gave."""

    passed: int
    total: int
    status: Literal["ok", "load_error", "timeout", "crashed", "setup_failed"]
    detail: str = ""  # load error type, or the runner's stderr when setup failed
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
    """A CodeTests from the answer column's JSON (see the module docstring), or None when it is not one."""
    try:
        spec = json.loads(answer) if isinstance(answer, str) else answer
    except ValueError:
        return None
    if isinstance(spec, list):
        spec = {"tests": spec}
    if not isinstance(spec, dict):
        return None
    prefix, suffix = spec.get("prefix", ""), spec.get("suffix", "")
    tests = spec.get("tests", [])
    if "cases" in spec:
        tests = _case_tests(spec.get("entry"), spec["cases"])
    ok = (
        isinstance(prefix, str) and isinstance(suffix, str) and isinstance(tests, list) and 0 < len(tests) <= _MAX_TESTS
    )
    return CodeTests(tuple(tests), prefix, suffix) if ok and all(isinstance(t, str) for t in tests) else None


def _case_tests(entry: Any, cases: Any) -> Any:
    if not (isinstance(entry, str) and entry.isidentifier() and isinstance(cases, list)):
        return None
    if not all(isinstance(c, list) and len(c) == 2 and isinstance(c[0], list) for c in cases):
        return None
    return [f"assert {entry}(*{json.dumps(args)}) == {json.dumps(want)}" for args, want in cases]


@functools.cache
def probe_isolation() -> Isolation:
    """The strongest isolation this machine allows: 'root' (namespaces + a fresh uid), 'userns' (namespaces inside
    an unprivileged user namespace) or 'none'. Tries each for real once per process."""
    modes: list[Isolation] = ["root", "userns"] if os.geteuid() == 0 else ["userns"]
    for mode in modes:
        req = {"probe": True, "nonce": "", "program": "", "tests": [], "per_test_s": 1.0}
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
    """Run `program` (the whole program: see `program_for`), then each of spec.tests, in a fresh sandboxed process.
    Never raises for bad code: whatever the program does shows in the RunResult."""
    nonce = secrets.token_hex(16)
    req = {"nonce": nonce, "program": program, "tests": list(spec.tests), "per_test_s": limits.per_test_s}
    return _run_request(mode, req, limits, slot)


def run_program(program: str, limits: SandboxLimits, mode: Isolation, output_kb: int = 8) -> RunResult:
    """Run `program` alone (no tests) in a fresh sandboxed process and read back its first `output_kb` KiB of
    printed output (the `python` tool, forge/env/builtin.py). Never raises for bad code."""
    req = {"nonce": secrets.token_hex(16), "program": program, "tests": [], "per_test_s": limits.per_test_s,
           "output_kb": output_kb}  # fmt: skip
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


def _run_request(mode: Isolation, req: dict, limits: SandboxLimits, slot: int) -> RunResult:
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
        return _spawn(req, limits.timeout_s)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _spawn(req: dict, timeout_s: float) -> RunResult:
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
    return _parse(req, out, err, timed_out, proc.returncode)


def _read_until(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes, bool]:
    """stdout and stderr (each capped) until both close or the deadline passes."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
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
                elif len(bufs[key.fileobj]) < _RESULT_CAP:
                    bufs[key.fileobj] += chunk[: _RESULT_CAP - len(bufs[key.fileobj])]
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


def _parse(req: dict, out: bytes, err: bytes, timed_out: bool, returncode: int) -> RunResult:
    if req.get("probe"):
        ok = out.startswith(b"ok\n") and returncode == 0
        return RunResult(0, 0, "ok" if ok else "setup_failed", err.decode(errors="replace").strip())
    total, passed, status, detail, output = len(req["tests"]), set(), "crashed", "", ""
    prefix = req["nonce"] + " "
    for line in out.decode(errors="replace").splitlines():
        if not line.startswith(prefix):
            continue
        what = line[len(prefix) :].split()
        if what[:1] == ["output"]:
            output = _hex_text(what[1] if len(what) > 1 else "")
        elif what[:1] == ["load"]:
            status, detail = "load_error", " ".join(what[1:])
        elif what == ["done"]:
            status = "ok"
        elif len(what) == 2 and what[0].isdigit() and what[1] == "1" and int(what[0]) < total:
            passed.add(int(what[0]))
    if status != "ok" and timed_out:
        status = "timeout"
    if returncode == 3 or (status == "crashed" and b"sandbox setup failed" in err):
        status, detail = "setup_failed", err.decode(errors="replace").strip()[-500:]
    return RunResult(len(passed), total, status, detail, output)


def _hex_text(hex_text: str) -> str:
    try:
        return bytes.fromhex(hex_text).decode(errors="replace")
    except ValueError:
        return ""
