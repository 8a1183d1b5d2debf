"""The code_exec sandbox: right code scores 1, partly right its share, hostile code 0 and leaves nothing behind."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from pathlib import Path

import psutil
import pytest

from forge.config import RewardConfig
from forge.errors import UserError
from forge.rewards import code_exec as ce
from forge.rewards.code_exec import CodeExecConfig
from forge.rewards.registry import resolve_verifiers
from forge.rewards.score import score_completions
from forge.tasks.code import (
    EVAL_FILE,
    OP_EVAL_FILE,
    OP_TRAIN_FILE,
    TRAIN_FILE,
    generate_function_tasks,
    generate_operator_tasks,
    to_jsonl,
)

MODE = ce.probe_isolation()
needs_sandbox = pytest.mark.skipif(MODE == "none", reason="no namespaces on this machine: code_exec refuses to run")
LIMITS = ce.SandboxLimits(timeout_s=3.0, per_test_s=1.5, workers=2)
# f(x) = x + 3 on five inputs
TESTS = json.dumps([f"assert f({x}) == {x + 3}" for x in (0, 1, 2, 5, -4)])


def _sandbox_processes(owner: int | None = None) -> list[psutil.Process]:
    """Processes running under the sandbox uids of process `owner` (default: this one; other forge processes on the
    machine have their own). There should never be any once a run returned."""
    first = ce._UID_BASE + ((owner or os.getpid()) % 100_000) * 64
    left = []
    for p in psutil.process_iter(["uids"]):
        uids = p.info["uids"]
        if uids is not None and first <= uids.real < first + 64:
            left.append(p)
    return left


@pytest.fixture
def clean_machine():
    """Asserts after the test that no child process and no sandbox-uid process is left."""
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    yield
    after = {c.pid for c in me.children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE}
    assert after <= before, f"processes left behind: {after - before}"
    assert _sandbox_processes() == []


def _verifier(limits: ce.SandboxLimits = LIMITS):
    return ce.make_code_exec(limits)


def test_parse_tests_forms():
    assert ce.parse_tests('["assert f(1) == 2"]') == ce.CodeTests(("assert f(1) == 2",))
    spec = ce.parse_tests({"prefix": "def f(x): return ", "tests": ["assert f(0) == 0"]})
    assert spec == ce.CodeTests(("assert f(0) == 0",), "def f(x): return ")
    cases = ce.parse_tests('{"entry": "g", "cases": [[[1, 2], 3], [["a", "b"], "ab"]]}')
    assert cases.tests == ("assert g(*[1, 2]) == 3", "assert g(*['a', 'b']) == 'ab'")  # Python literals, not JSON
    for bad in ("not json", "[]", '{"tests": [1]}', '{"entry": "1x", "cases": [[[1], 1]]}', "3", '{"prefix": 1}'):
        assert ce.parse_tests(bad) is None, bad


@needs_sandbox
def test_right_code_scores_one_and_partial_code_its_share(clean_machine):
    completions = [
        "```python\ndef f(x):\n    return x + 3\n```",  # all 5
        "def f(x):\n    return x + 3 if x > 0 else 0",  # x=1,2,5 pass; 0 and -4 fail: 3/5
        "def f(x):\n    return x * 3",  # none
        "I cannot write code.",  # does not parse: 0
        "def f(x): return x + 3",  # right, but its answer is not a test spec: cannot be scored
    ]
    answers = [TESTS] * 4 + ["garbage"]
    scores = _verifier()(prompts=["p"] * 5, completions=completions, answer=answers)
    assert scores == [1.0, 0.6, 0.0, 0.0, None]


@needs_sandbox
def test_each_test_has_its_own_time_limit(clean_machine):
    program = "def f(x):\n    while x == 2:\n        pass\n    return x + 3"  # hangs on f(2) only
    result = ce.run_sandboxed(program, ce.parse_tests(TESTS), LIMITS, MODE)
    assert (result.passed, result.total, result.status) == (4, 5, "ok")


HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "infinite_loop": "while True:\n    pass\n",
    "alloc_10gb": "buf = bytearray(10 * 2**30)\n",
    "socket_connect": "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1).sendall(b'hi')\n",
    "exit_early": "import os\nos._exit(0)\n",
    "forge_results": (  # result lines without the run's nonce, on stdout and on every fd that may be the channel
        "import os, sys\nfor fd in range(1, 10):\n    for i in range(5):\n        try:\n"
        "            os.write(fd, f'{i} 1\\n'.encode())\n        except OSError:\n            pass\n"
        "raise SystemExit(0)\n"
    ),
}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_scores_zero_and_leaves_nothing(name, clean_machine):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    program = HOSTILE[name].replace("PORT", str(port)) + "def f(x):\n    return x + 3\n"  # right, if it got there
    result = ce.run_sandboxed(program, ce.parse_tests(TESTS), LIMITS, MODE)
    assert result.score == 0.0, result
    if name == "alloc_10gb":
        assert result.detail.startswith("MemoryError")  # refused by RLIMIT_AS: the memory was never taken
    if name == "socket_connect":
        assert result.detail.startswith("OSError: [Errno 101] Network is unreachable")
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the host's loopback
    if name in ("infinite_loop", "fork_bomb"):
        assert result.status in ("load_error", "timeout") and "MemoryError" not in result.detail
    server.close()


@needs_sandbox
def test_fork_is_capped_and_daemons_die_with_the_run(clean_machine):
    """RLIMIT_NPROC of the fresh uid stops forking at reward.code_exec.max_procs; children that detach (setsid) and would
    outlive the program are killed with its PID namespace when it exits."""
    program = (
        "import os, time\nforks = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            os.setsid()\n            time.sleep(60)\n            os._exit(0)\n        forks += 1\n"
        "except OSError:\n    pass\n"
    )
    limits = ce.SandboxLimits(timeout_s=5.0, per_test_s=4.0, max_procs=8)
    tests = ce.CodeTests(("assert forks >= 3", "assert forks < 8"), trusted=True)  # free-form: a trusted suite
    result = ce.run_sandboxed(program, tests, limits, MODE)
    assert (result.passed, result.total) == (2, 2), result  # it forked, and was stopped below 8 processes


@needs_sandbox
def test_writes_outside_the_temp_dir_fail_and_touch_nothing(clean_machine, tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # world-writable, so only the sandbox's read-only mounts stop the write
    targets = [
        open_dir / "canary",
        Path.cwd() / "canary-from-sandbox",
        Path("/dev/shm/canary-from-sandbox"),
        Path("/var/tmp/canary-from-sandbox"),
        Path(ce.__file__),  # overwrite forge's own source
    ]
    original = Path(ce.__file__).read_bytes()
    programs = [f"def f(x):\n    open({str(t)!r}, 'w').write('x')\n    return x + 3\n" for t in targets]
    programs.append("import os\ndef f(x):\n    os.mkdir('/root/sandbox-canary')\n    return x + 3\n")
    inside = "def f(x):\n    open('scratch.txt', 'w').write('x' * 100)\n    return x + 3 if open('scratch.txt').read() else 0"
    scores = _verifier()(prompts=["p"] * 7, completions=[*programs, inside], answer=[TESTS] * 7)
    assert scores == [0.0] * 6 + [1.0]  # the working directory itself is writable
    for t in targets[:4]:
        assert not t.exists(), t
    assert not Path("/root/sandbox-canary").exists()
    assert Path(ce.__file__).read_bytes() == original


@needs_sandbox
def test_output_is_capped_and_env_is_empty(clean_machine, monkeypatch):
    monkeypatch.setenv("FORGE_SECRET_TOKEN", "hunter2")
    program = (
        "import os\nassert 'FORGE_SECRET_TOKEN' not in os.environ\nimport sys\n"
        "try:\n    while True:\n        sys.stdout.write('y' * 65536)\nexcept OSError:\n    pass\n"
        "def f(x):\n    return x + 3\n"
    )
    result = ce.run_sandboxed(program, ce.parse_tests(TESTS), LIMITS, MODE)  # writes past RLIMIT_FSIZE fail
    assert (result.passed, result.status) == (5, "ok")


@pytest.mark.skipif(ce.probe_isolation() != "root", reason="needs root to also try the unprivileged-user path")
def test_user_namespace_mode_isolates_too(clean_machine):
    """The path taken where forge does not run as root: namespaces inside a user namespace, then a nested one."""
    assert ce._run_request("userns", {"probe": True, "nonce": "", "program": "", "tests": []}, LIMITS, 0).status == "ok"
    right = ce.run_sandboxed("def f(x): return x + 3", ce.parse_tests(TESTS), LIMITS, "userns")
    canary = Path.cwd() / "canary-userns"
    write = ce.run_sandboxed(
        f"open({str(canary)!r}, 'w')\ndef f(x): return x+3", ce.parse_tests(TESTS), LIMITS, "userns"
    )
    net = ce.run_sandboxed(HOSTILE["socket_connect"].replace("PORT", "9"), ce.parse_tests(TESTS), LIMITS, "userns")
    assert (right.score, write.score, net.score) == (1.0, 0.0, 0.0)
    # read-only where the checkout is visible to the sandbox; absent where it lies under /tmp (the sandbox's own)
    refused = ("OSError: [Errno 30] Read-only file system", "FileNotFoundError: [Errno 2]")
    assert write.detail.startswith(refused) and not canary.exists()


@needs_sandbox
def test_batch_runs_on_a_bounded_pool_and_runs_each_distinct_program_once(clean_machine, monkeypatch):
    running, peak, calls, lock = [0], [0], [], threading.Lock()
    real = ce.run_sandboxed

    def counting(program, spec, limits, mode, slot=0):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            calls.append((program, slot))
        try:
            return real(program, spec, limits, mode, slot)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(ce, "run_sandboxed", counting)
    programs = [f"import time\ntime.sleep(0.3)\ndef f(x):\n    return x + {k}\n" for k in range(6)]
    completions = programs + programs + ["not python ("]  # every program twice, plus one that does not parse
    scores = _verifier(ce.SandboxLimits(timeout_s=3.0, workers=3))(
        prompts=["p"] * 13, completions=completions, answer=[TESTS] * 13
    )
    assert scores == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0] * 2 + [0.0]
    assert len(calls) == 6 and peak[0] == 3  # 6 distinct programs, 3 at a time; the unparsable one never ran
    assert {slot for _, slot in calls} == {0, 1, 2}


def test_refuses_without_a_network_namespace_unless_allowed(monkeypatch):
    monkeypatch.setattr(ce, "probe_isolation", lambda: "none")
    with pytest.raises(UserError, match="--allow-network-code") as e:
        resolve_verifiers(["code_exec"], RewardConfig())
    assert "\n" not in str(e.value)
    [(name, fn)] = resolve_verifiers(["code_exec"], RewardConfig(code_exec=CodeExecConfig(allow_network=True)))
    assert name == "code_exec"
    scores = fn(prompts=["p"] * 2, completions=["def f(x): return x + 3", "def f(x): return x"], answer=[TESTS] * 2)
    assert scores == [1.0, 0.0]  # runs, with rlimits and a temp dir only


@pytest.mark.parametrize(
    "field,value",
    [
        ("timeout_s", math.nan),
        ("timeout_s", 0.0),
        ("memory_mb", 8),
        ("workers", 0),
        ("workers", 65),
    ],
)
def test_bad_limits_are_one_line_errors(field, value):
    with pytest.raises(UserError, match=f"reward.code_exec.{field}"):
        resolve_verifiers(["code_exec"], RewardConfig(code_exec=CodeExecConfig(**{field: value})))


def test_shipped_task_files_match_the_generator():
    train, evaluation = generate_function_tasks()
    assert TRAIN_FILE.read_bytes() == to_jsonl(train) and EVAL_FILE.read_bytes() == to_jsonl(evaluation)
    assert len(train) == 500 and len(evaluation) == 100
    assert not {r["id"] for r in train} & {r["id"] for r in evaluation}
    train, evaluation = generate_operator_tasks()
    assert OP_TRAIN_FILE.read_bytes() == to_jsonl(train) and OP_EVAL_FILE.read_bytes() == to_jsonl(evaluation)
    assert (len(train), len(evaluation)) == (108, 27)


@needs_sandbox
def test_fill_in_the_middle_operator_task(clean_machine):
    rows = [json.loads(line) for line in OP_EVAL_FILE.read_text().splitlines()]
    [(name, fn)] = resolve_verifiers(["code_exec"], RewardConfig())
    assert ce.program_for("*", ce.parse_tests(rows[0]["answer"])).endswith(
        "*" + json.loads(rows[0]["answer"])["suffix"]
    )
    right = fn(prompts=[""] * 27, completions=[r["solution"] for r in rows], answer=[r["answer"] for r in rows])
    wrong = fn(prompts=[""] * 27, completions=["+" if r["solution"] != "+" else "-" for r in rows],
               answer=[r["answer"] for r in rows])  # fmt: skip
    assert right == [1.0] * 27
    # a wrong operator fails at least one of the five asserts
    assert all(w < 1.0 for w in wrong)


@needs_sandbox
def test_task_reference_solutions_pass_and_a_constant_scores_its_share(clean_machine):
    rows = [json.loads(line) for line in EVAL_FILE.read_text().splitlines()]
    [(name, fn)] = resolve_verifiers(["code_exec"], RewardConfig())
    right = [r["solution"] + "\n\nThis function returns" for r in rows]  # trailing prose is cut off
    res = score_completions([(name, fn)], None, [r["prompt"] for r in rows] * 2, right + [" 0"] * len(rows),
                            {"answer": [r["answer"] for r in rows] * 2})  # fmt: skip
    scores = res.scores[:, 0].tolist()
    assert scores[:100] == [1.0] * 100
    # `return 0` passes exactly the asserts whose expected value equals 0 (False, 0.0 too, as in Python)
    wants = [[eval(t.split(" == ")[1]) for t in json.loads(r["answer"])["tests"]] for r in rows]
    expected = [sum(type(w) in (int, bool, float) and w == 0 for w in ws) / 5 for ws in wants]
    assert scores[100:] == pytest.approx(expected) and max(expected) < 1.0


@needs_sandbox
def test_eval_counts_a_completion_correct_only_when_every_test_passes(clean_machine):
    from forge.config import EvalConfig, RewardConfig
    from forge.evaluate import _correct, eval_verifier_specs, resolve_eval_verifiers

    reward = RewardConfig(verifiers=["code_exec"])
    judges = resolve_eval_verifiers(eval_verifier_specs(EvalConfig(), reward), None, reward)
    texts = ["def f(x): return x + 3", "def f(x): return x + 3 if x > 0 else 0", "nonsense"]
    assert [n for n, _ in judges] == ["code_exec"]
    assert _correct(judges, ["p"] * 3, ["p"] * 3, texts, {"answer": [TESTS] * 3}, 0.0, {}) == [True, False, False]


@needs_sandbox
def test_a_run_dies_with_the_process_that_started_it(clean_machine, tmp_path):
    """forge SIGKILLed mid-run (no timeout handling left to run): the sandbox goes with it."""
    import subprocess
    import sys
    import time

    script = (
        "from forge.rewards import code_exec as ce\n"
        "ce.run_sandboxed('import time\\ntime.sleep(120)', ce.CodeTests(('assert 1 == 1',)), "
        "ce.SandboxLimits(timeout_s=100.0, per_test_s=100.0), ce.probe_isolation())\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    try:  # 120 s: 30 were too short once on a loaded 2-core machine (CI beside a bench)
        deadline = time.monotonic() + 120
        while not _sandbox_processes(parent.pid) and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.1)
        assert _sandbox_processes(parent.pid), "the sandboxed program never started"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _sandbox_processes(parent.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandbox_processes(parent.pid) == []
