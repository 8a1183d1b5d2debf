"""Stop what a run started even when its process is killed: `python -m flows.reaper --watch PID`.

A private Ray instance (`flows.ray_exec.ray_session` without `orchestration.ray_address`) is started by the run's
own process; Ray stops it on `ray.shutdown()`, and its GCS and raylet also die with that process, but Ray 2.60's
dashboard and runtime-env agents outlive a driver killed by SIGKILL (seen here: still running minutes later). This
watchdog, started in a session of its own, records the watched process's descendants (pid and start time) twice
a second; once the watched process is gone it sends SIGKILL to every recorded descendant that still runs (same
pid, same start time: a recycled pid is left alone) and exits. On a normal end the run stops it with SIGTERM.
Standard library only; Linux (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of a process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None and s[2] != "Z":
            children.setdefault(s[0], []).append(int(entry.name))
            starts[int(entry.name)] = s[1]
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = starts[pid]
        todo.extend(children.get(pid, []))
    return out


def kill_recorded(recorded: dict[int, int]) -> list[int]:
    """SIGKILL each recorded process that still runs with the recorded start time; returns the pids signalled."""
    killed = []
    for pid, start in recorded.items():
        s = _stat(pid)
        if s is not None and s[1] == start and s[2] != "Z":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def watch(pid: int) -> None:
    me = os.getpid()
    recorded: dict[int, int] = {}
    while _stat(pid) is not None and _stat(pid)[2] != "Z":
        recorded = {p: t for p, t in descendants(pid).items() if p != me}
        time.sleep(POLL_S)
    kill_recorded(recorded)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kill a process's descendants once it is gone")
    ap.add_argument("--watch", type=int, required=True, help="pid of the process to watch")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the run ended normally: nothing to do
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the run
    watch(args.watch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
