"""Real servers for tests and benches: free 127.0.0.1 ports, readiness checks, processes started in their own
session and stopped by PID (never by name)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers 200 (fails early if `proc`, the server being waited for, died)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc is None or proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(url)


def start(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """Start a process in its own session (so it and its children can be stopped together), output to a log."""
    with open(log_path, "w") as log:
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Stop a process we started (and its process group) by PID: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
