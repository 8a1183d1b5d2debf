"""Issue 46, the sandbox sees no user data and holds no identity: code run by `code_exec` and the `python` tool, in
every mode this machine runs (root; userns, forced; userns as an ordinary user), cannot read the user's files, reach
the user's sockets, or show the user's uid and groups.

The user's data is faked outside /tmp (the sandbox's /tmp is its own), beside the checkout: a home with `.ssh` (0600
in 0700, as ssh wants), `.ray` and a runs directory whose `.stack/credentials` is world-readable (as the issue found
run files to be), a session bus socket in a 0700 `run/user/<uid>`, and a Docker-like socket (0666: even a stranger
could connect where the path is visible). Before issue 46 a program in userns mode read and connected to all of it,
and in root mode read the world-readable files and connected to the 0666 socket.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from forge.rewards import code_exec as ce
from tests.test_code_exec import LIMITS, clean_machine  # noqa: F401 - clean_machine is a fixture

PROBE_REQ = {"probe": True, "program": "", "checks": [], "per_test_s": 1.0}
MODES = [m for m in ("root", "userns") if ce._run_request(m, PROBE_REQ, ce.SandboxLimits(), 0).status == "ok"]
PROBE = r"""
import glob, json, os, socket

def read(path):
    try:
        with open(path, "rb") as f:
            return f"read {f.read(16)!r}"
    except OSError as e:
        return type(e).__name__

def listing(path):
    try:
        return "listed " + ",".join(sorted(os.listdir(path)))
    except OSError as e:
        return type(e).__name__

def connect(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()

def seen():
    found = {p: read(p) for p in FILES}
    found.update({p: listing(p) for p in DIRS})
    found.update({p: connect(p) for p in SOCKETS + glob.glob("/run/user/*/bus")})
    found["/proc/self/environ"] = read("/proc/self/environ")
    return found

def leaks():
    return sorted(p for p, what in seen().items() if is_leak(p, what))

def is_leak(path, what):
    if what.startswith("listed ") and set(what[len("listed "):].split(",")) <= set(TO_PYTHON.get(path, ())):
        return False  # the way to the interpreter (e.g. /root holding only .pyenv)
    return what.startswith(("read", "listed", "connected")) and what != "read b''"  # empty: no env to show

def identity():
    return [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups()), sorted(os.environ)]
"""


def _fake_user(root: Path, owner: int = -1, group: int = -1) -> dict:
    """The user's data under `root` (owned by `owner`, the Docker-like socket by `group`): what the probe tries."""
    home = root / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ray" / "session_latest").mkdir(parents=True)
    (home / "runs" / ".stack").mkdir(parents=True)
    secrets = {".ssh/id_ed25519": 0o600, ".ray/session_latest/token": 0o644, "runs/.stack/credentials": 0o644}
    for name, mode in secrets.items():
        (home / name).write_text("SECRET " + name)
        (home / name).chmod(mode)
    (root / "run" / "user" / "1000").mkdir(parents=True, mode=0o700)
    listeners, sockets = [], [str(root / "run/user/1000/bus"), str(root / "docker.sock")]
    for path in sockets:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen()
        listeners.append(s)
    os.chmod(sockets[0], 0o600 if owner >= 0 else 0o666)
    os.chmod(sockets[1], 0o660 if owner >= 0 else 0o666)
    for path in [root, *root.rglob("*")]:
        os.lchown(path, owner, owner)
    if group >= 0:  # like Docker's: root's, and open to a group the user is in
        os.lchown(sockets[1], 0, group)
    files = [str(home / n) for n in secrets] + ["/etc/shadow", "/root/.bashrc", str(Path.cwd() / "pyproject.toml")]
    return {
        "FILES": files,
        "DIRS": [str(home), str(root), "/home", "/root", "/run", "/var/run", "/work", str(Path.cwd())],
        "SOCKETS": [*sockets, "/var/run/docker.sock", "/run/docker.sock"],
        "listeners": listeners,
    }


@pytest.fixture
def user_data():
    root = Path(tempfile.mkdtemp(dir=Path.cwd(), prefix=".sandbox-user-"))  # not under /tmp: the sandbox has its own
    root.chmod(0o755)
    found = _fake_user(root)
    yield found
    for s in found["listeners"]:
        s.close()
    shutil.rmtree(root)


def _to_python() -> dict[str, list[str]]:
    """{directory: the entries the sandbox may list there}: the directories above sys.base_prefix and
    sys.executable, which the sandbox's root recreates so that the interpreter sits at its own paths (e.g. /root
    holding only .pyenv, the checkout only .venv)."""
    ways: dict[str, list[str]] = {}
    for path in (os.path.realpath(sys.base_prefix), sys.executable):
        parts = Path(path).parts
        for i in range(1, len(parts)):
            ways.setdefault(str(Path(*parts[:i])), []).append(parts[i])
    return ways


def _probe(found: dict) -> str:
    names = {k: found[k] for k in ("FILES", "DIRS", "SOCKETS")} | {"TO_PYTHON": _to_python()}
    return "".join(f"{k} = {v!r}\n" for k, v in names.items()) + PROBE


@pytest.mark.skipif(not MODES, reason="no namespaces on this machine: code_exec refuses to run")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("clean_machine")
def test_sandboxed_code_reads_no_user_file_and_reaches_no_user_socket(mode, user_data):
    program = _probe(user_data)
    tool = ce.run_program(program + "print(json.dumps([leaks(), seen(), identity()]))", LIMITS, mode, output_kb=16)
    assert tool.status == "ok", tool
    leaked, seen, (uid, euid, gid, egid, groups, env) = json.loads(tool.output)
    assert leaked == [], {p: seen[p] for p in leaked}  # the python tool's view
    assert seen["/proc/self/environ"] in ("read b''", "PermissionError")  # the runner was started with none
    assert {p: seen[p] for p in user_data["SOCKETS"][:2]} == dict.fromkeys(
        user_data["SOCKETS"][:2], "FileNotFoundError"
    )
    # no identity of the user: a uid no account has (root mode) or nobody (userns), no groups, no variables
    assert uid == euid and gid == egid and uid not in (0, os.getuid()) and gid not in (0, os.getgid())
    assert (uid >= ce._UID_BASE) if mode == "root" else (uid, gid) == (65534, 65534)
    assert groups == [] and env == ["HOME", "LANG", "PATH", "TMPDIR"]
    # code_exec's view: the same probe as hidden tests; an honest program still scores
    spec = ce.parse_tests(["assert leaks() == []", "assert identity()[4] == []"])
    assert ce.run_sandboxed(program, spec, LIMITS, mode).score == 1.0
    assert ce.run_sandboxed("def f(x): return x + 3", ce.parse_tests(["assert f(1) == 4"]), LIMITS, mode).score == 1.0


def _python_for(uid: int) -> str | None:
    """An interpreter an unprivileged uid can run (this one may live under a 0700 home), or None."""
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            ok = subprocess.run(
                [python, "-I", "-S", "-c", f"open({str(ce._RUNNER)!r}).close()"],
                user=uid, group=uid, extra_groups=[], env={}, cwd="/", capture_output=True,
            ).returncode == 0  # fmt: skip
        except OSError:  # e.g. an interpreter under a 0700 home
            ok = False
        if ok:
            return python
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to an unprivileged uid to play the user: needs root")
@pytest.mark.usefixtures("clean_machine")
def test_as_an_ordinary_user_the_sandbox_sees_none_of_their_data_sockets_or_groups():
    """The mode an ordinary user gets (userns), run as one: uid U with a supplementary group G that may use a
    Docker-like socket (0660, root's, group G), a bus socket 0600 and a 0600 key of their own. The kernel keeps U's
    groups for access checks (an unprivileged user namespace cannot drop them), so only hiding the paths stops this."""
    user, group = 1_800_000_000 + os.getpid() % 100_000, 1_800_100_000 + os.getpid() % 100_000
    python = _python_for(user)
    if python is None:
        pytest.skip("no Python interpreter here that an unprivileged uid can run")
    root = Path(tempfile.mkdtemp(dir=Path.cwd(), prefix=".sandbox-user-"))
    root.chmod(0o755)
    try:
        found = _fake_user(root, user, group)
        program = _probe(found) + "print(json.dumps([leaks(), identity()]))"
        req = {"program": program, "checks": [], "per_test_s": 2.0, "output_kb": 16, "mode": "userns", "uid": 0,
               "gid": 0, "cpu_s": 5, "memory_mb": 256, "max_procs": 8, "file_kb": 1024, "tmpfs_kb": 8192, "workdir": ""}  # fmt: skip
        run = subprocess.run(
            [python, "-I", "-S", "-B", str(ce._RUNNER), "10"], input=json.dumps(req).encode(), capture_output=True,
            user=user, group=user, extra_groups=[group], env={}, cwd="/", timeout=30,
        )  # fmt: skip
        result = ce._parse(req, (), run.stdout, run.stderr, False, run.returncode)
    finally:
        for s in found["listeners"]:
            s.close()
        shutil.rmtree(root)
    if result.status == "setup_failed" and "unshare" in result.detail:
        pytest.skip(f"an unprivileged user cannot create namespaces here: {result.detail}")
    assert result.status == "ok", result
    leaked, (uid, euid, gid, egid, groups, _) = json.loads(result.output)
    assert leaked == [], leaked
    assert (uid, euid, gid, egid) == (65534,) * 4 and user not in groups and group not in groups


@pytest.mark.skipif(not MODES, reason="no namespaces on this machine: code_exec refuses to run")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("clean_machine")
def test_what_honest_code_needs_is_still_there(mode):
    """The standard library (a C extension too), randomness, the time zone, the work dir, and a child interpreter
    started as sys.executable (the venv's path: only the interpreter file is there)."""
    program = (
        "import decimal, json, os, random, subprocess, sys, time\n"
        "open('notes.txt', 'w').write(json.dumps([random.random() < 1, len(os.urandom(4)), time.localtime().tm_year > 2000]))\n"
        "child = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True)\n"
        "print(open('notes.txt').read(), child.stdout.strip(), decimal.Decimal('1.5') * 2, os.getcwd())\n"
    )
    result = ce.run_program(program, LIMITS, mode)
    assert (result.status, result.output) == ("ok", "[true, 4, true] 42 3.0 /tmp/work\n")
