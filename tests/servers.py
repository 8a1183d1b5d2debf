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


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by one of `pids` (/proc/net/tcp{,6} + fds)."""
    by_inode = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # LISTEN
                addr, port = cols[1].split(":")
                by_inode[cols[9]] = (_address(addr), int(port, 16))
    out = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        out |= {by_inode[t[8:-1]] for t in links if t.startswith("socket:[") and t[8:-1] in by_inode}
    return out


def _address(hex_addr: str) -> str:
    """/proc/net's little-endian hex address as text: 0100007F -> 127.0.0.1; an IPv4-mapped IPv6 one as IPv4."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text.removeprefix("::ffff:")
