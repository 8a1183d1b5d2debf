"""Nothing a Ray-mode run starts outlives it: not after SIGTERM (the CLI's normal stop), not after SIGKILL of
the driver (a private Ray instance's agents would survive that without `flows.reaper`).

The CLI runs in a session of its own; every process Ray starts for it (GCS, raylet, agents, the stage actors)
inherits that session, so "what the run started" is read from /proc as the session's members.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
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


PRIVATE_PROBE = """
import json, os, stat, sys
import ray
from flows.ray_exec import ray_session
from forge.config import RunConfig

def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)

with ray_session(RunConfig(), {"pools": [{"name": "cpu"}]}, "private"):
    node = ray._private.worker.global_worker.node
    token = os.environ["RAY_AUTH_TOKEN_PATH"]
    gcs = [p for p in node.all_processes.get("gcs_server", [])][0].process.pid
    gcs_env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{gcs}/environ", "rb").read().split(b"\\0") if b"=" in kv)
    seen = {"token": token, "token_mode": mode(token), "session": node.get_session_dir_path(),
            "root_mode": mode(os.path.dirname(token)), "root_uid": os.stat(os.path.dirname(token)).st_uid,
            "auth_mode": os.environ.get("RAY_AUTH_MODE"), "gcs_token_path": gcs_env[b"RAY_AUTH_TOKEN_PATH"].decode(),
            "pool": ray.cluster_resources().get("pool:cpu"),
            "driver_creds": sorted(k for k in os.environ if k.startswith(("MLFLOW_TRACKING_P", "PREFECT_API_AUTH"))),
            "gcs_creds": sorted(k.decode() for k in gcs_env if k.startswith((b"MLFLOW_TRACKING_P", b"PREFECT_API_AUTH"))),
            "actor_creds": ray.get(ray.remote(lambda: sorted(k for k in os.environ if "AUTH_STRING" in k
                                                             or "TRACKING_PASSWORD" in k)).remote())}
seen["token_left"] = os.path.exists(seen["token"])
seen["env_after"] = os.environ.get("RAY_AUTH_TOKEN_PATH")
print(json.dumps(seen))
"""


def test_private_ray_keeps_its_token_0600_and_its_folders_in_a_0700_dir(tmp_path):
    """Issue 46: Ray itself writes ~/.ray/auth_token 0644 and makes /tmp/ray/session_* (and its sockets and logs)
    0777; the private instance's token is a 0600 file of its own, its folders lie in a 0700 directory of the user,
    its GCS authenticates with that token, and afterwards the file is gone and the environment as it was. Its
    processes do not get the stack's credentials the driver holds."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(key, None)
    env |= {"PREFECT_API_AUTH_STRING": "forgeweave:admin", "MLFLOW_TRACKING_PASSWORD": "admin"}  # the stack's, say
    proc = subprocess.run([sys.executable, "-c", PRIVATE_PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    root = Path(seen["token"]).parent
    try:
        assert seen["pool"] == 1000.0 and seen["auth_mode"] == "token"
        assert seen["token_mode"] == 0o600 and seen["gcs_token_path"] == seen["token"]
        assert seen["root_mode"] == 0o700 and seen["root_uid"] == os.getuid()
        assert Path(seen["session"]).is_relative_to(root)  # Ray's 0777 folders, behind the 0700 one
        assert not (home / ".ray" / "auth_token").exists()  # Ray's own (0644) token file was never made
        assert not seen["token_left"] and seen["env_after"] is None
        # the driver keeps the stack's credentials (it tracks); no Ray process, and so no actor, has them
        assert seen["driver_creds"] == ["MLFLOW_TRACKING_PASSWORD", "PREFECT_API_AUTH_STRING"]
        assert seen["gcs_creds"] == [] and seen["actor_creds"] == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
