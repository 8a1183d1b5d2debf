"""Nothing a Ray-mode run starts outlives it: not after SIGTERM (the CLI's normal stop), not after SIGKILL of
the driver (a private Ray instance's agents would survive that without `flows.reaper`).

The CLI runs in a session of its own; every process Ray starts for it (GCS, raylet, agents, the stage actors)
inherits that session, so "what the run started" is read from /proc as the session's members.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flows.reaper import descendants
from flows.stack import proc_stats
from tests.servers import BIN, REPO

pytestmark = pytest.mark.slow
RAY_TINY = ["--set", "orchestration.execution=ray", "--set", "steps=100000", "--set", "eval.every=0",
            "--set", "checkpoint.every=0", "--set", "tracking.mlflow=false"]  # fmt: skip


def session_members(sid: int) -> list[int]:
    return [pid for pid, f in proc_stats() if int(f[3]) == sid and f[0] != "Z"]


def start_run(runs_dir: Path, name: str) -> subprocess.Popen:
    cmd = [str(BIN / "forgeweave"), "run", "--preset", "tiny", "--name", name, "--runs-dir", str(runs_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([*cmd, "--quiet", "--no-prefect", *RAY_TINY], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = runs_dir / name / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:  # the actors serve and steps run
            return proc
        time.sleep(0.2)
    raise AssertionError(f"the run did not get going: {proc.communicate()[1][-3000:]}")


def wait_gone(sid: int, timeout: float = 30.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and session_members(sid):
        time.sleep(0.2)
    return session_members(sid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_process_outlives_a_stopped_or_killed_driver(runs_dir, sig):
    proc = start_run(runs_dir, "r")
    workers = json.loads((runs_dir / "r" / "workers.json").read_text())
    actors = [w["pid"] for ws in workers.values() for w in ws]
    started = session_members(proc.pid)
    assert set(actors) <= set(started) and len(started) > len(actors) + 2  # actors + GCS, raylet, agents
    assert set(descendants(proc.pid)) >= set(actors)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) != 0
    assert wait_gone(proc.pid) == [], "processes outlived the run"
    assert _reapers_gone(proc.pid) == [], "the watchdog outlived the run"
    if sig == signal.SIGTERM:
        status = json.loads((runs_dir / "r" / "status.json").read_text())
        assert status["state"] == "failed"


def _reapers_gone(pid: int, timeout: float = 15.0) -> list[int]:
    """The watchdog exits right after its last kill (SIGKILL) or on the run's SIGTERM to it, a moment after the
    run's processes are gone: what is still there after `timeout` outlived the run."""
    deadline = time.time() + timeout
    while time.time() < deadline and _reapers(pid):
        time.sleep(0.2)
    return _reapers(pid)


def _reapers(pid: int) -> list[int]:
    """Live `flows.reaper --watch PID` processes (in a session of their own)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if b"flows.reaper" in cmd and str(pid).encode() in cmd:
            out.append(int(entry.name))
    return out


def test_a_run_starts_its_own_ray_even_where_another_cluster_is_advertised(monkeypatch):
    """`ray start` (the stack's Ray head) leaves its address in /tmp/ray/ray_current_cluster, and RAY_ADDRESS may
    name a cluster: without orchestration.ray_address a run still starts its private instance (it used to try to
    join that cluster and fail: "num_cpus must not be provided")."""
    import ray

    from flows.ray_exec import ray_session
    from forge.config import RunConfig

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # advertised, dead
    with ray_session(RunConfig(), {"pools": [{"name": "cpu"}]}, "private"):
        assert ray.cluster_resources().get("pool:cpu") == 1000.0
    assert not ray.is_initialized()
