"""The pipeline's side of a multi-process update: start the ranks once, drive them step by step, stop them.

`start_trainer` gives the recipe an in-process `forge.trainer.Trainer` when the update has one process (the
rollout then samples from the trainer's own module), and a `RemoteTrainer` otherwise. `RemoteTrainer` has the
interface the recipe uses (`update`, `policy_version`, `unwrapped`, `state_dict`, `restore`, `close`):

- Start: `python -m accelerate.commands.launch --multi_gpu --num_processes N ... -m forge.distributed.worker` in
  its own process group (with `ACCELERATE_USE_CPU=1` on CPU: `--cpu` would silently start ONE process, and
  without the CPU flag the ranks would train alone). Rank 0 connects back to a `multiprocessing.connection`
  listener on 127.0.0.1 (random port, random authkey passed in the environment) and reports every rank's pid.
- Each step: the `ScoredBatch` goes to the ranks as a `torch.save` file in the publication directory (RAM-backed
  /dev/shm when present); rank 0 replies with the `UpdateStats` after publishing the new weights
  (`forge.weights`), which are loaded into the pipeline's rollout model at once; the version in the file must be
  the one rank 0 reported, so stale weights cannot reach the rollout.
- Checkpoints: rank 0 writes the trainer state (gathered to full tensors under FSDP) to a file the pipeline
  folds into the usual checkpoint; resume sends the checkpoint directory and every rank restores from it.
  Checkpoints are those of a one-process run, so a run can resume with a different process count.
- Stop: `close()` asks the ranks to stop, then SIGTERMs (and at last SIGKILLs) whatever is left of the
  launcher's process group and of the ranks, by pid (torchrun starts each rank in a process group of its own),
  also after an error or Ctrl-C (the CLI turns SIGTERM into an exception that ends here). Should the pipeline
  itself be killed, rank 0 sees its connection close and exits, and the launcher stops the other ranks.
- A rank that dies fails the call with `TrainerProcessError`, naming the rank and its error or exit signal
  (from the rank's error file, or the launcher's failure report in `update/trainer.log`); the trainer is then
  unusable and `--resume` continues from the last checkpoint.

Files in `<run>/update/`: config.yaml (what the ranks build), trainer.log (all ranks' output), processes.json
(launcher and rank pids), rank-<r>.error.json (a rank's error).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Listener
from pathlib import Path

import torch

import forge
from forge.checkpoint import assign_weights
from forge.config import RunConfig, dump_yaml
from forge.errors import UserError
from forge.io import atomic_write_bytes, atomic_write_text, write_json
from forge.records import ScoredBatch, UpdateStats
from forge.trainer import Trainer
from forge.weights import load_published, publication_dir

START_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0
# failures of the collectives that only say another rank went away first
_PEER_GONE = re.compile(r"closed by peer|remote worker|Connection reset|Broken pipe|DistBackendError", re.I)


class TrainerProcessError(UserError):
    """An update rank failed (died, raised, or the launch did not come up); the message names the rank."""


def update_processes(cfg: RunConfig, plan: dict | None) -> int:
    """update.num_processes if set, else what the plan gives the update stage, else 1."""
    if cfg.update.num_processes > 0:
        return cfg.update.num_processes
    for a in (plan or {}).get("assignments", []):
        if a.get("stage") == "update":
            return sum(p["processes"] for p in a["placements"])
    return 1


def start_trainer(model, cfg: RunConfig, run_dir: Path, plan: dict | None = None) -> Trainer | RemoteTrainer:
    """In-process Trainer (one process; the rollout shares its module) or RemoteTrainer (persistent ranks)."""
    n = update_processes(cfg, plan)
    if n == 1:
        ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.beta > 0 else None
        return Trainer(model, cfg, total_steps=cfg.steps, ref_model=ref)
    if torch.cuda.is_available():
        model = model.to("cuda")  # the pipeline's copy serves the rollout
    return RemoteTrainer(model, cfg, run_dir, n, plan)


def _on_gpu(plan: dict | None) -> bool:
    for a in (plan or {}).get("assignments", []):
        if a.get("stage") == "update":
            return a.get("kind") == "gpu"
    return torch.cuda.is_available()


class RemoteTrainer:
    """Persistent update ranks behind the Trainer interface; `unwrapped` is the pipeline's rollout model."""

    def __init__(self, model, cfg: RunConfig, run_dir: Path, processes: int, plan: dict | None = None):
        self.model, self.cfg, self.processes = model, cfg, processes
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "update"
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("rank-*.error.json"):
            stale.unlink()
        atomic_write_text(self.dir / "config.yaml", dump_yaml(cfg))
        self.publications = publication_dir(self.run_dir)
        self.policy_version = 0
        self.failure: TrainerProcessError | None = None
        self.pids: list[int] = []
        self._closed = False
        self._busy = False
        self.conn = None
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        self.log_path = self.dir / "trainer.log"
        self.proc = self._launch(authkey, plan)
        self._finalizer = weakref.finalize(self, _stop_all, self.proc, self.pids, 0.0)
        try:
            self._connect()
            self._sync(self._call("publish"))  # the rollout starts from exactly the ranks' weights
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ the Trainer interface

    @property
    def unwrapped(self):
        return self.model

    def update(self, batch: ScoredBatch) -> UpdateStats:
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        path = self.publications / "batch.pt"
        atomic_write_bytes(path, buffer.getvalue())
        reply = self._call("update", batch=str(path))
        t0 = time.perf_counter()
        self._sync(reply["publish"])
        sync = reply["publish"]["seconds"] + time.perf_counter() - t0
        return dataclasses.replace(reply["stats"], sync_seconds=sync)

    def state_dict(self) -> dict:
        path = self.dir / "trainer_state.pt"
        self._call("state", path=str(path))
        state = torch.load(path, weights_only=False)
        path.unlink()
        return state

    def restore(self, ckpt: Path, state: dict) -> None:
        self._sync(self._call("restore", checkpoint=str(Path(ckpt).resolve())))
        assert self.policy_version == state["policy_version"], "ranks restored another policy version"

    def rank_checksums(self) -> list[list[float]]:
        """Each rank's per-tensor parameter sums (equal lists = the ranks hold the same weights; DDP only)."""
        return self._call("checksums")["checksums"]

    def close(self) -> None:
        """Stop the ranks (gracefully when idle and healthy), then make sure the whole process group is gone."""
        if self._closed:
            return
        self._closed = True
        _stop_all(self.proc, self.pids, STOP_GRACE_S if self._ask_to_stop() else 0.0)
        self._finalizer.detach()
        for c in (self.conn, self._listener):
            if c is not None:
                c.close()
        if self.publications.name.startswith("forgeweave-"):  # ours, in /dev/shm: free the memory
            shutil.rmtree(self.publications, ignore_errors=True)
        else:
            (self.publications / "batch.pt").unlink(missing_ok=True)

    # ------------------------------------------------------------ machinery

    def _ask_to_stop(self) -> bool:
        """True when the ranks were idle and healthy and rank 0 acknowledged `stop` (they then exit by themselves)."""
        if self.conn is None or self.failure is not None or self._busy or self.proc.poll() is not None:
            return False
        try:
            self.conn.send({"op": "stop"})
            return bool(self.conn.poll(STOP_GRACE_S)) and self.conn.recv().get("ok", False)
        except (OSError, EOFError):
            return False

    def _launch(self, authkey: bytes, plan: dict | None) -> subprocess.Popen:
        gpu = _on_gpu(plan)
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *launch_args(self.processes, _free_port(), gpu),
            "-m",
            "forge.distributed.worker",
            "--connect",
            "{}:{}".format(*self._listener.address),
            "--run-dir",
            str(self.run_dir.resolve()),
            "--processes",
            str(self.processes),
        ]
        env = worker_env(self.cfg, self.processes, gpu, plan)
        env["FORGEWEAVE_TRAINER_AUTHKEY"] = authkey.hex()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _connect(self) -> None:
        box: dict = {}
        accept = threading.Thread(target=_accept_into, args=(self._listener, box), daemon=True)
        accept.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while accept.is_alive():
            accept.join(0.2)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._fail("the update processes did not start")
        if "conn" not in box:
            self._fail(f"rank 0 could not connect: {box.get('error')}")
        self.conn = box["conn"]
        hello = self._receive()
        self.pids.extend(hello["pids"])  # in place: the finalizer holds this list
        info = {"launcher": self.proc.pid, "ranks": self.pids, "backend": hello["backend"]}
        write_json(self.dir / "processes.json", info)

    def _call(self, op: str, **kwargs) -> dict:
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise TrainerProcessError("the update processes were stopped; start the run again with --resume")
        self._busy = True
        try:
            self.conn.send({"op": op, **kwargs})
        except (OSError, EOFError):
            self._fail(f"sending '{op}' to rank 0 failed")
        reply = self._receive()
        self._busy = False
        return reply

    def _receive(self) -> dict:
        while True:
            try:
                if self.conn.poll(0.2):
                    return self.conn.recv()
            except (OSError, EOFError):
                self._fail("rank 0 closed its connection")
            if self.proc.poll() is not None:
                self._fail("the update processes exited")

    def _sync(self, published: dict) -> None:
        """Load rank 0's publication into the rollout model; its version must be the one rank 0 reported."""
        state, version = load_published(Path(published["path"]))
        if version != published["version"]:
            raise RuntimeError(f"published weights are version {version}, rank 0 reported {published['version']}")
        assign_weights(self.model, state, source=published["path"])
        self.policy_version = version

    def _fail(self, what: str):
        """Stop everything, then raise the error of the rank that failed first."""
        _stop_all(self.proc, self.pids, STOP_GRACE_S)
        self.failure = TrainerProcessError(
            diagnose(self.dir, self.log_path, self.processes, self.proc.returncode, what)
        )
        self._busy = False
        raise self.failure


def launch_args(processes: int, port: int, gpu: bool) -> list[str]:
    """`accelerate launch` arguments for N synchronised local ranks (--multi_gpu also on CPU, see the docstring)."""
    return [
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "bf16" if gpu else "no",
        "--dynamo_backend",
        "no",
        "--monitor_interval",
        "0.1",
    ]


def worker_env(cfg: RunConfig, processes: int, gpu: bool, plan: dict | None) -> dict[str, str]:
    """The ranks' environment: this forge on PYTHONPATH, threads per rank, CPU flag or the plan's GPUs."""
    env = dict(os.environ)
    root = str(Path(forge.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    threads = cfg.threads if cfg.threads > 0 else max(1, (os.cpu_count() or 1) // processes)
    env["OMP_NUM_THREADS"] = env["FORGEWEAVE_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    if gpu:
        devices = _plan_devices(plan)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    else:
        env["ACCELERATE_USE_CPU"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _plan_devices(plan: dict | None) -> list[int]:
    for a in (plan or {}).get("assignments", []):
        if a.get("stage") == "update":
            return list(a["placements"][0].get("devices", []))
    return []


def diagnose(update_dir: Path, log_path: Path, processes: int, returncode: int | None, what: str) -> str:
    """One line naming the rank that failed first and why, from the ranks' error files and the launcher's report."""
    errors = _error_files(update_dir)
    exits = _launcher_exits(log_path)
    rank, why = _first_failure(errors, exits)
    where = f"; log: {log_path}"
    if rank is None:
        code = f" (launcher exit code {returncode})" if returncode is not None else ""
        return f"update failed: {what}{code}{where}"
    return f"update rank {rank} of {processes} failed: {why}{where}"


def _error_files(update_dir: Path) -> dict[int, dict]:
    out = {}
    for f in update_dir.glob("rank-*.error.json"):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        out[int(info["rank"])] = info
    return out


def _launcher_exits(log_path: Path) -> dict[int, int]:
    """rank -> exit code from torchrun's failure report ('rank : 1 (local_rank: 1)' / 'exitcode : -9')."""
    try:
        text = log_path.read_text(errors="replace")[-200_000:]
    except OSError:
        return {}
    pairs = re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", text)
    return {int(r): int(c) for r, c in pairs}


def _first_failure(errors: dict[int, dict], exits: dict[int, int]) -> tuple[int | None, str]:
    """Own errors first (not those that only say a peer vanished), then deaths by a signal the launcher did not
    send (it stops the survivors with SIGTERM), then anything."""
    own = sorted((e["time"], r) for r, e in errors.items() if not _PEER_GONE.search(e["error"]))
    if own:
        r = own[0][1]
        return r, errors[r]["error"]
    killed = [r for r, c in sorted(exits.items()) if c < 0 and -c != signal.SIGTERM and r not in errors]
    for r in killed or [r for r, c in sorted(exits.items()) if r not in errors]:
        return r, _exit_text(exits[r])
    if errors:
        r = min(errors, key=lambda k: errors[k]["time"])
        return r, errors[r]["error"]
    return None, ""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code}); the other ranks were stopped"
    return f"exited with code {code}; the other ranks were stopped"


def _accept_into(listener: Listener, box: dict) -> None:
    try:
        box["conn"] = listener.accept()
    except Exception as e:  # closed listener, failed authentication: reported by the waiting side
        box["error"] = f"{type(e).__name__}: {e}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_all(proc: subprocess.Popen, ranks: list[int], grace: float) -> None:
    """Wait up to `grace` s for the launcher to exit by itself, then SIGTERM and at last SIGKILL the launcher's
    process group and every rank (torchrun starts each rank in a process group of its own)."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not _signal_all(proc.pid, ranks, sig):
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (live_ranks(ranks) or group_members(proc.pid)):
            proc.poll()  # reap the launcher (our child)
            time.sleep(0.05)
    proc.poll()


def _signal_all(pgid: int, ranks: list[int], sig: int) -> bool:
    """Send `sig` to the launcher's group and the live ranks; False when none of them is left."""
    targets = live_ranks(ranks)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)  # the launcher leads its own session: the group is the launcher (and its helpers)
        return True
    return bool(targets)


def live_ranks(pids: list[int]) -> list[int]:
    """Those of `pids` that are still a running update rank (a recycled pid running something else is not)."""
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"forge.distributed.worker" in cmdline and state != "Z":
            out.append(pid)
    return out


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry.name))
    return members
