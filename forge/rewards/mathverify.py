"""Hugging Face math-verify (`parse` + `verify`) in a child process, with a hard bound on each check.

math-verify's own timeouts use `signal.alarm`, which only works on a process's main thread: called from the
reward stage's daemon thread (reward.score_timeout_s) or a Ray actor's thread it raises, and with its timeouts
off nothing bounds it (`10^{10^{10}}` or `1000000!` keep sympy busy far past any budget). A signal is also only
handled between Python bytecodes, so it cannot cut short one long call into C (a huge integer power).
So every check runs in one long-lived child process per parent process (forge/rewards/_math_verify_child.py,
started on first use, ~1 s to import math-verify), on the child's main thread:

- inside the child, math-verify's own timeouts (`MV_TIMEOUT_S` per parse and per comparison) and an address-space
  limit (`MEMORY_MIB`) stop most runaway work, and that check counts as no match;
- the parent waits at most `ITEM_TIMEOUT_S` per check; past it the child is killed (SIGKILL), the check counts
  as no match, and the next check starts a fresh child.

Both give 0.0, as math-verify itself scores a timeout, and log a warning (`forge.rewards.mathverify`). Ordinary
answers take milliseconds; one that hits the bounds costs seconds, so a batch made mostly of such answers can
exceed reward.score_timeout_s, which then stops the run with an error naming math_answer. The child
never evaluates the text with `eval`: math-verify parses LaTeX with its own grammar (latex2sympy2_extended) and
plain expressions with sympy's `parse_expr` only on what its regex allows (digits, `+-*/^()`, spaces, `.`).
Checks are serialised per process (a lock); the child is re-created after a fork.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

from forge.errors import UserError

MV_TIMEOUT_S = 2
"""math-verify's own timeout inside the child, whole seconds per parse and per comparison."""
ITEM_TIMEOUT_S = 10.0
"""Hard bound on one check (gold + prediction parsed, every comparison) before the child is killed."""
START_TIMEOUT_S = 60.0
"""Seconds the child may take to import math-verify."""
MEMORY_MIB = 4096
"""Address-space limit of the child (RLIMIT_AS); an answer too big to build in it is no match."""

_CHILD = Path(__file__).with_name("_math_verify_child.py")
log = logging.getLogger(__name__)


class MathVerifyMissing(UserError):
    """math-verify is not importable by this Python."""


class _Checker:
    """The child process and its pipes; `check` is the only entry point."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.owner = 0  # pid that started proc: after a fork the child belongs to the parent, not to us
        self.buf = b""
        self.missing = ""  # set once the child reported that math-verify cannot be imported

    def check(self, gold: str, pred: str, timeout_s: float) -> bool:
        with self.lock:
            proc = self._running()
            line = json.dumps({"gold": gold, "pred": pred}) + "\n"
            try:
                proc.stdin.write(line.encode())
                proc.stdin.flush()
                reply = self._read_line(time.monotonic() + timeout_s)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:
                self._stop()
                log.warning("math_answer: a math-verify check took over %gs and was stopped; scored 0.0", timeout_s)
                return False
            out = json.loads(reply)
            if out["gave_up"]:
                log.warning("math_answer: math-verify hit its time or memory limit on an answer; scored 0.0")
            return bool(out["match"])

    def _running(self) -> subprocess.Popen:
        if self.missing:
            raise MathVerifyMissing(self.missing)
        if self.proc is not None and self.owner == os.getpid() and self.proc.poll() is None:
            return self.proc
        self.proc, self.owner, self.buf = self._start(), os.getpid(), b""
        ready = self._read_line(time.monotonic() + START_TIMEOUT_S)
        status = json.loads(ready) if ready else {"error": f"no reply within {START_TIMEOUT_S:g}s"}
        if "error" in status:
            self._stop()
            self.missing = (
                f"math_answer needs math-verify for answers that are not plain numbers, and {sys.executable} cannot "
                f"import it ({status['error']}); install it with `make setup` (or pip install 'math-verify>=0.8')"
            )
            raise MathVerifyMissing(self.missing)
        return self.proc

    def _start(self) -> subprocess.Popen:
        # -P: the script's folder (forge/rewards, which holds a math.py) must not shadow the standard library
        argv = [sys.executable, "-P", "-B", str(_CHILD), str(MV_TIMEOUT_S), str(MEMORY_MIB)]
        return subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True
        )

    def _read_line(self, deadline: float) -> str | None:
        """The child's next output line, or None when it closed stdout or the deadline passed."""
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or self.owner != os.getpid():
            return
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            f.close()


_checker = _Checker()
atexit.register(lambda: _checker.lock.acquire(timeout=1) and _checker._stop())


def math_verify_match(gold: str, pred: str, timeout_s: float = ITEM_TIMEOUT_S) -> bool:
    r"""Whether math-verify finds `pred`'s final answer equal to `gold` (both texts are parsed; see module doc).

    Raises MathVerifyMissing when math-verify is not installed.

    >>> math_verify_match("$\\frac{1}{2}$", r"so the answer is \boxed{0.5}"), math_verify_match("$[1,2)$", "$[1,2]$")
    (True, False)
    """
    return _checker.check(gold, pred, timeout_s)
