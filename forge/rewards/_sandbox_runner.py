"""Child side of the `code_exec` sandbox. Stdlib only; run as `python -I -S -B _sandbox_runner.py` with an empty env.

Reads one JSON request on stdin, then (mode "root" or "userns"):

  S (this process, session leader): new mount, network, PID, IPC and UTS namespaces (plus a user namespace in
    "userns" mode); forks C and exits with C's status.
  C (PID 1 of the new PID namespace; dies with S through PR_SET_PDEATHSIG): remounts every mount read-only, builds
    a fresh root on a tmpfs (read-only bind mounts of /usr, /bin, /lib..., two files of /etc, the Python
    installation; /dev/null and its like; a fresh size-capped tmpfs on /tmp, the work dir; a fresh /proc) and
    pivots into it, detaching the old root: no home, /run, /var, socket or checkout is left to reach. Forks W and
    exits when W does, which makes the kernel kill everything left in the namespace.
  W: rlimits, no_new_privs, drops to an unprivileged uid with no groups (root mode: a fresh uid per slot; userns
    mode: a nested user namespace in which it is nobody, 65534), points fd 1/2 at a capped file, then writes "ready" on the results fd, execs the program
    ("loaded" or "load <error>") and evaluates each check, writing its VALUE as JSON ("<i> <json>", or "<i> !")
    as soon as it ends, then "done"; with `output_kb` in the request (the `python` tool), then what the program
    printed, as "output <hex>". W never sees an expected value and judges nothing: forge compares the values
    (forge/rewards/code_judge.py), and reads any line out of this order as a forgery.

The program shares W's interpreter, so it could rewrite anything here; what W needs after the program has run
(compile, exec, eval, os.write, the timer, the JSON encoder's pieces) is bound before it runs, so patching
builtins or this module does not reach it, and the encoder calls no method of the program's objects. That is
hygiene, not a boundary: the boundary is that the expected values never enter this process.

Mode "none" (no namespaces; only with reward.code_exec.allow_network) skips the namespaces and mounts and runs W in a
temporary directory with the same rlimits. `{"probe": true}` sets everything up and reports "ok" without running code.
"""

import _json
import ctypes
import json
import os
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # fmt: skip
MNT_DETACH = 2
NOBODY = 65534  # the sandbox's uid and gid inside its user namespace (userns mode)
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217, "i686": 217}
_libc = ctypes.CDLL(None, use_errno=True)
NEW_ROOT = "/tmp"  # where the sandbox's root is built before pivoting into it (over the host's /tmp, in its namespace)


class _TestTimeout(BaseException):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(src.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode() or None),
        f"mount {target}",
    )


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces(mode: str) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    if mode == "userns" and uid == 0:
        os.setgroups([])  # an unprivileged user cannot drop its groups: the user namespace keeps them (unmapped)
    _check(_libc.unshare(flags | (CLONE_NEWUSER if mode == "userns" else 0)), "unshare")
    if mode == "userns":
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) for every mount this namespace sees, parents first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            target = fields[4].encode().decode("unicode_escape")  # \040 etc.
            keep = sum(_KEEP_FLAGS.get(opt, 0) for opt in fields[5].split(","))
            points.append((target, keep))
    return sorted(points, key=lambda p: p[0].count("/"))


def _read_only_filesystem(req: dict) -> None:
    """A fresh root holding only what the interpreter needs, every piece read-only, a private tmpfs on /tmp and a
    fresh /proc; then pivot into it, so nothing else of the machine (homes, /run, /work, sockets) is reachable."""
    _mount("none", "/", "", MS_REC | MS_PRIVATE)
    for target, keep in _mount_points():
        try:
            _mount("none", target, "", MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError as e:
            if os.path.exists(target) and not target.startswith(("/proc", "/sys")):
                raise OSError(e.errno, f"cannot make {target} read-only: {e.strerror}") from None
    umask = os.umask(0o022)  # the sandbox uid must traverse the directories made here
    try:
        _build_root(req, NEW_ROOT)
    finally:
        os.umask(umask)
    _pivot_root(NEW_ROOT)


def _build_root(req: dict, new: str) -> None:
    """On a small tmpfs at `new`: bind mounts of the paths in `root_paths()` (read-only: their mounts were made so),
    the harmless devices, an empty /dev/shm, the work tmpfs on /tmp and a fresh /proc; then the tmpfs read-only.
    The sources are opened first: the tmpfs covers `new` (/tmp), where one of them may lie."""
    sources = [(p, _source(p)) for p in [*root_paths(), *(f"/dev/{n}" for n in ("null", "zero", "full", "urandom"))]]
    on_tmp = [(p, src) for p, src in sources if p.startswith("/tmp/")]  # a venv in a checkout under /tmp
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,nr_inodes=4096,mode=0755")
    for path, source in sources:
        if (path, source) not in on_tmp:
            _graft(path, source, new)
    for name in ("/dev/shm", "/tmp", "/proc"):
        os.makedirs(new + name, 0o755, exist_ok=True)
    os.symlink("urandom", new + "/dev/random")
    owner = f",uid={req['uid']},gid={req['gid']}" if req["mode"] == "root" else ""
    work = f"size={req['tmpfs_kb']}k,nr_inodes=1024,mode=0700{owner}"
    _mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, work)
    _graft_on_tmp(on_tmp, new)
    # a proc of this PID namespace only: the sandbox's own processes (userns mode writes its uid_map there)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("none", new, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _graft_on_tmp(on_tmp: list[tuple[str, str | int]], new: str) -> None:
    """Paths under /tmp (the interpreter of a venv in a checkout under /tmp), which the work tmpfs would hide: each
    top directory (/tmp/<name>) becomes a small tmpfs over the work one, the paths are grafted into it, and it is made
    read-only, so the code can run them but writes nothing there."""
    tops = sorted({"/tmp/" + path.split("/")[2] for path, _ in on_tmp})
    for top in tops:
        os.makedirs(new + top, 0o755, exist_ok=True)
        _mount("tmpfs", new + top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
    for path, source in on_tmp:
        _graft(path, source, new)
    for top in tops:
        _mount("none", new + top, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def root_paths() -> list[str]:
    """What the sandbox's root holds: the system's programs and libraries (/usr and the /bin, /lib... beside it), the
    dynamic linker's cache and the time zone from /etc, the Python installation (sys.base_prefix: the interpreter and
    its standard library) and the interpreter at sys.executable's path (a venv's bin/python: the file alone, so that
    code starting `sys.executable` works). Not the venv's packages (`-I -S`: not importable in the sandbox anyway),
    not this script (loaded already), nothing of a home, /run, /var or the working tree. Paths under another in the
    list are dropped (bound with it)."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime"]
    paths += [os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable)), sys.executable]
    paths = sorted({os.path.normpath(p) for p in paths if os.path.lexists(p)})
    return [p for p in paths if not any(p.startswith(q + "/") for q in paths)]


def _source(path: str) -> str | int:
    """What to graft at `path`: for a symlink right under / (merged /usr: /lib -> usr/lib) its target, to make the
    same link; else an O_PATH descriptor of what it resolves to."""
    if os.path.islink(path) and os.path.dirname(path) == "/":
        return os.readlink(path)
    return os.open(path, os.O_PATH | os.O_CLOEXEC)


def _graft(path: str, source: str | int, new: str) -> None:
    """`source` (`_source`) at `path` under `new`: the same symlink, or a bind mount of the file or directory; the
    directories above it made here (0755, empty but for what is grafted)."""
    inside = new + path
    os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
    if isinstance(source, str):
        os.symlink(source, inside)
        return
    if os.path.isdir(f"/proc/self/fd/{source}"):
        os.mkdir(inside, 0o755)
    else:
        os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    _mount(f"/proc/self/fd/{source}", inside, "", MS_BIND | MS_REC)
    os.close(source)


def _pivot_root(new: str) -> None:
    """Make `new` this mount namespace's root and detach the old one (pivot_root(".", ".") as in pivot_root(2)). A
    chroot would leave the old root in the namespace, reachable again by a process that gets CAP_SYS_CHROOT in a user
    namespace of its own, and the kernel refuses user namespaces to chrooted processes (userns mode needs one)."""
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(38, f"pivot_root: no syscall number known for {os.uname().machine}")
    os.chdir(new)
    _check(_libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def _limits(req: dict) -> None:
    mb = 1 << 20
    for res, value in (
        (resource.RLIMIT_CPU, req["cpu_s"]),
        (resource.RLIMIT_AS, req["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, req["file_kb"] * 1024),
        (resource.RLIMIT_NPROC, req["max_procs"]),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ):
        resource.setrlimit(res, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing


def _drop_privileges(req: dict) -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if req["mode"] == "root":
        os.setgroups([])
        os.setresgid(req["gid"], req["gid"], req["gid"])
        os.setresuid(req["uid"], req["uid"], req["uid"])
    elif req["mode"] == "userns":
        # we are uid 0 of our own user namespace, with its capabilities (enough to undo the read-only mounts);
        # a nested namespace mapping nobody (65534) onto us, then setuid(65534), drops them all
        _check(_libc.unshare(CLONE_NEWUSER), "unshare user")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{NOBODY} 0 1")
        _write("/proc/self/gid_map", f"{NOBODY} 0 1")
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)


def _worker(req: dict, results: int) -> None:
    """W: isolate further, then run the program and its tests, reporting each test on `results`."""
    _limits(req)
    _drop_privileges(req)
    if req["mode"] == "none":  # no PID namespace to take us down with the runner
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    work = req.get("workdir") or "/tmp/work"
    os.makedirs(work, mode=0o700, exist_ok=True)
    os.chdir(work)
    os.environ.clear()
    os.environ.update({"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    out = os.open(os.path.join(work, ".output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    if req.get("probe"):
        os.write(results, b"ok\n")
        return
    _run_tests(req, results)


def _line_writer(results: int):
    """A function writing one line on the results fd, bound now to os.write and str.encode: a program that later
    replaces os.write (or closes the fd) cannot make it write elsewhere, only fail (a missing line fails its test)."""
    write, encode = os.write, str.encode

    def line(text: str) -> None:
        data = encode(text + "\n", "ascii", "backslashreplace")
        try:
            while data:
                data = data[write(results, data) :]
        except OSError:
            pass

    return line


def _run_tests(req: dict, results: int) -> None:
    line = _line_writer(results)
    if req.get("output_kb"):  # printed lines in the order they were printed, stdout and stderr interleaved
        sys.stdout.reconfigure(line_buffering=True)
    try:
        _run_program(req, line)
    finally:
        if req.get("output_kb"):
            _report_output(req, line)


def _report_output(req: dict, line) -> None:
    """What the program printed (stdout and stderr, its first output_kb KiB) as one hex line: "output <hex>"."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program may have closed or replaced it
            pass
    try:
        with open(os.path.join(req.get("workdir") or "/tmp/work", ".output"), "rb") as f:
            printed = f.read(int(req["output_kb"]) * 1024)
    except OSError:
        printed = b""
    line("output " + printed.hex())


def _compile_check(check: dict) -> tuple | None:
    """(kind, code, expected code) for one check of the request, compiled before the program can touch `compile`;
    None for one that does not compile (it fails)."""
    try:
        if "stmt" in check:
            return ("stmt", compile(check["stmt"], "<test>", "exec"), None)
        expected = compile(check["expected"], "<test>", "eval") if check.get("expected") else None
        return ("pair" if expected else "expr", compile(check["expr"], "<test>", "eval"), expected)
    except BaseException:  # noqa: BLE001 - a test that does not compile fails
        return None


class _NoValue(Exception):
    pass


def encoder(max_chars: int = 1 << 20):
    """encode(value) -> the value as JSON text, for a value built only of exact built-in types (None, bool, int,
    float, str, bytes, list, tuple, dict, set, frozenset; tuples, sets, dicts and bytes tagged as {"t"|"s"|"d"|"b":
    ...}, forge/rewards/code_judge.py decodes them); raises for anything else, nesting past 100 levels or text past
    `max_chars`. It looks only at exact types (`type(v) is int`) and walks containers itself, so it never calls a
    method of the program's objects (`__eq__`, `__repr__`, `__iter__`, `__hash__`...). What it uses is bound now,
    before the program runs (built-in names are looked up when called; built-in types cannot be patched).

    >>> encoder()([None, True, 2, 2.5, float("nan"), 'a"b', (1,), {"k": b"\\x01"}, {3}])
    '[null, true, 2, 2.5, NaN, "a\\\\"b", {"t": [1]}, {"d": [["k", {"b": "01"}]]}, {"s": [3]}]'
    """
    kind, size, esc, join, numbered = type, len, _json.encode_basestring_ascii, "".join, enumerate
    int_repr, float_repr, to_hex, items = int.__repr__, float.__repr__, bytes.hex, dict.items
    floats = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
    opening = {list: "[", tuple: '{"t": [', set: '{"s": [', frozenset: '{"s": [', dict: '{"d": ['}

    def walk(v, depth: int, out: list) -> None:
        t = kind(v)
        if depth > 100:
            raise _NoValue
        if v is None:
            out.append("null")
        elif t is bool:
            out.append("true" if v else "false")
        elif t is int:
            out.append(int_repr(v))
        elif t is float:
            out.append(floats.get(float_repr(v), float_repr(v)))
        elif t is str:
            out.append(esc(v))
        elif t is bytes:
            out.append('{"b": "' + to_hex(v) + '"}')
        elif t is list or t is tuple or t is set or t is frozenset or t is dict:  # `is`: no __hash__ of t
            out.append(opening[t])
            container(items(v) if t is dict else v, t is dict, depth + 1, out)
            out.append("]" if t is list else "]}")
        else:
            raise _NoValue

    def container(values, pairs: bool, depth: int, out: list) -> None:
        for i, x in numbered(values):  # an exact list, tuple, set, frozenset or dict view: C iteration, no program code
            out.append(", " if i else "")
            if pairs:  # x: the (key, value) tuple the dict view made
                out.append("[")
                walk(x[0], depth, out)
                out.append(", ")
                walk(x[1], depth, out)
                out.append("]")
            else:
                walk(x, depth, out)

    def encode(value) -> str:
        out: list = []
        walk(value, 0, out)
        text = join(out)
        if size(text) > max_chars:
            raise _NoValue
        return text

    return encode


def _run_program(req: dict, line) -> None:
    """Load the program, then evaluate each check and write its value: "ready", "loaded" (or "load <error>"), one
    "<i> <JSON value>" per check ("<i> !" when it raised or its value cannot be sent), "done". The verdict is the
    parent's (forge/rewards/code_judge.py): nothing here knows the expected values."""
    checks = [_compile_check(c) for c in req.get("checks", [])]
    check, count = _checker(float(req["per_test_s"])), enumerate
    sys.setrecursionlimit(10_000)
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    line("ready")  # from here on an early exit is the program's doing, never a sandbox that failed to start
    loaded = check(("load", req["program"], None), scope)
    if loaded != "true":
        line(f"load {loaded}")
        return
    line("loaded")
    for i, c in count(checks):
        line(f"{i} {check(c, scope) if c is not None else '!'}")
    line("done")


def _checker(per_test: float):
    """check(compiled check, scope) -> its payload: the JSON of the value (a pair: of both values), "true" for a
    statement that ran, "!" when it raised, timed out or gave a value `encoder` refuses. ("load", source, None)
    loads the program: "true", or why it failed. Bound now to compile, exec, eval, the timer and the encoder,
    before the program runs."""
    build, run, evaluate, encode, describe = compile, exec, eval, encoder(), _describe
    set_timer, on_signal, alarm_signal, real_timer = signal.setitimer, signal.signal, signal.SIGALRM, signal.ITIMER_REAL

    def alarm(signum, frame):
        raise _TestTimeout

    def check(compiled: tuple, scope: dict) -> str:
        how, code, expected = compiled
        try:
            try:
                on_signal(alarm_signal, alarm)
                set_timer(real_timer, per_test)
                if how in ("stmt", "load"):
                    run(code if how == "stmt" else build(code, "<completion>", "exec"), scope)
                    return "true"
                value = encode(evaluate(code, scope))
                return value if how == "expr" else "[" + value + ", " + encode(evaluate(expected, scope)) + "]"
            finally:
                set_timer(real_timer, 0)
        except BaseException as e:  # noqa: BLE001 - anything the program does counts against it
            return describe(e) if how == "load" else "!"

    return check


def _describe(e: BaseException) -> str:
    """'<type>: <message>' on one line (both come from the program: anything may go wrong)."""
    try:
        text = f"{type(e).__name__}: {e}"
        return " ".join(text.split())[:200] or "?"
    except BaseException:  # noqa: BLE001
        return "?"


def _init(req: dict, alive: int) -> int:
    """C: PID 1 of the new namespace. Returns the exit status for S. `alive` reads EOF once S has died."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if select.select([alive], [], [], 0)[0]:  # S died before the prctl took effect (getppid() is 0 in here)
        return 1
    os.close(alive)
    _read_only_filesystem(req)
    w = os.fork()
    if w == 0:
        _child_main(req)
    while True:  # reap everything; leave when W has ended (the namespace's other processes die with us)
        pid, status = os.wait()
        if pid == w:
            return os.waitstatus_to_exitcode(status) & 0xFF


def _child_main(req: dict) -> None:
    code = 0
    try:
        _worker(req, results=_RESULTS_FD)
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        code = 3
    os._exit(code)


_RESULTS_FD = 1


def req_wall_s() -> float:
    """The caller's wall-clock timeout, passed as argv[1] so it applies before the request is read."""
    try:
        return max(1.0, float(sys.argv[1]))
    except (IndexError, ValueError):
        return 60.0


def main() -> int:
    global _RESULTS_FD
    # if forge dies (or forgets us), so do we, and our namespace with us: no run outlives its caller's deadline
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    signal.alarm(int(req_wall_s()) + 2)
    req = json.loads(sys.stdin.buffer.read(64 << 20))
    _RESULTS_FD = os.dup(1)  # results travel on the original stdout; the program's stdout goes to a file
    try:
        if req["mode"] == "none":
            pid = os.fork()
            if pid == 0:
                _child_main(req)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) & 0xFF
        _enter_namespaces(req["mode"])
        alive, keep = os.pipe()
        c = os.fork()
        if c == 0:
            os.close(keep)
            try:
                os._exit(_init(req, alive))
            except BaseException as e:  # noqa: BLE001
                os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
                os._exit(3)
        return os.waitstatus_to_exitcode(os.waitpid(c, 0)[1]) & 0xFF
    except OSError as e:
        sys.stderr.write(f"sandbox setup failed: {e}\n")
        return 3


if __name__ == "__main__":
    sys.exit(main())
