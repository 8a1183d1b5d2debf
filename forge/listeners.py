"""Who listens on a local TCP port: a server forgeweave started, or another local process that took the port first
(a squatter that answers the health check would otherwise be taken for the server). Linux's /proc only: the
socket's inode from /proc/net/tcp(6), then the process whose descriptors hold it; elsewhere nothing is checked."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def foreign_listener(port: int, group: int) -> str:
    """'' when the socket listening on 127.0.0.1:`port` belongs to a process of process group `group` (the server
    forgeweave started, in a session of its own) or cannot be looked up (no /proc); else who holds it ("pid N", or
    "a process this user cannot see")."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return ""
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        if wanted & _open_files(pid):
            with contextlib.suppress(OSError):
                return "" if os.getpgid(pid) == group else f"pid {pid}"
    return "a process this user cannot see"


def _open_files(pid: int) -> set[str]:
    """What process `pid`'s file descriptors point at (`socket:[inode]` for a socket); what cannot be read, left out
    (another user's process, a descriptor closed meanwhile)."""
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def _listening_inodes(port: int) -> set[str] | None:
    """The inodes of the sockets listening on `port` (/proc/net/tcp, tcp6; state 0A), None where there is no /proc."""
    if not Path("/proc/net/tcp").is_file():
        return None
    found = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:  # tcp6 is absent where IPv6 is off
            continue
        for cols in (row.split() for row in rows):
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(cols[9])
    return found
