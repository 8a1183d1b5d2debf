"""One update rank: `python -m accelerate.commands.launch --multi_gpu --num_processes N -m forge.distributed.worker`.

Every rank builds the policy the pipeline built (same config, same seed), wraps it in a `forge.trainer.Trainer`
(DDP, or FSDP with `update.strategy=fsdp`) and then serves commands until told to stop. Only rank 0 talks to the
pipeline (a `multiprocessing.connection` client on 127.0.0.1, authenticated with the key in
$FORGEWEAVE_TRAINER_AUTHKEY); it broadcasts each command to the other ranks, every rank executes it, and rank 0
replies. Commands (small dicts; tensors travel as files):

- `publish`: rank 0 writes the current weights with their policy version (`forge.weights`).
- `update`: every rank loads the step's `ScoredBatch` file, trains on its share, then `publish`.
- `state`: rank 0 writes the trainer state (optimizer, adaptive LR, step, version) to the given path.
- `restore`: every rank loads a checkpoint's weights and trainer state, then `publish`.
- `checksums`: each rank's per-tensor parameter sums (to check that the ranks hold the same weights).
- `stop`: leave the loop; the processes exit 0.

A rank that raises writes `rank-<r>.error.json` (its error and traceback) into the update directory before it
exits with code 1, so the pipeline can name it. Rank 0 also exits when the pipeline's connection closes (the
pipeline died), removing the run's /dev/shm publication directory: no rank, and no shared memory, outlives the
pipeline. The wait for the next command is a collective, so the process group's timeout is long (a day): a rank
that dies is noticed at once (its sockets close), one that hangs is not.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import shutil
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client
from pathlib import Path

import torch
import torch.distributed as dist

from forge.checkpoint import load_state
from forge.config import load_yaml
from forge.io import atomic_write_bytes, write_json
from forge.models import load_policy
from forge.trainer import Trainer, make_accelerator
from forge.weights import publication_dir, publish_weights

COMMAND_WAIT = timedelta(days=1)


class Worker:
    def __init__(self, cfg, run_dir: Path, accelerator):
        self.accelerator = accelerator
        self.rank = accelerator.process_index
        model, _ = load_policy(cfg.model, seed=cfg.seed)
        ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.beta > 0 else None
        self.trainer = Trainer(model, cfg, total_steps=cfg.steps, ref_model=ref, accelerator=accelerator)
        self.publications = publication_dir(run_dir)

    def publish(self, cmd: dict) -> dict:
        t0 = time.perf_counter()
        weights = self.trainer.full_weights()  # a collective under FSDP
        version = self.trainer.policy_version
        path = publish_weights(weights, self.publications, version) if self.rank == 0 else None
        return {"path": str(path), "version": version, "seconds": time.perf_counter() - t0}

    def update(self, cmd: dict) -> dict:
        batch = torch.load(cmd["batch"], weights_only=False)
        stats = self.trainer.update(batch)
        return {"stats": stats, "publish": self.publish(cmd)}

    def state(self, cmd: dict) -> dict:
        state = self.trainer.state_dict()  # a collective under FSDP
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            atomic_write_bytes(cmd["path"], buffer.getvalue())
        return {"path": cmd["path"]}

    def restore(self, cmd: dict) -> dict:
        ckpt = Path(cmd["checkpoint"])
        self.trainer.restore(ckpt, load_state(ckpt)["trainer"])
        return self.publish(cmd)

    def checksums(self, cmd: dict) -> dict:
        mine = [float(p.detach().double().sum()) for p in self.trainer.unwrapped.parameters()]
        every: list = [None] * self.accelerator.num_processes
        dist.all_gather_object(every, mine)
        return {"checksums": every}


def serve(worker: Worker, conn) -> None:
    """Receive (rank 0) and broadcast each command, run it on every rank, reply (rank 0) until `stop`."""
    handlers = {
        "publish": worker.publish,
        "update": worker.update,
        "state": worker.state,
        "restore": worker.restore,
        "checksums": worker.checksums,
    }
    while True:
        box = [conn.recv() if conn is not None else None]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd["op"] == "stop":
            if conn is not None:
                conn.send({"ok": True})
            return
        reply = handlers[cmd["op"]](cmd)
        if conn is not None:
            conn.send(reply)


def _hello(accelerator, expected: int) -> dict:
    """Check the launch really gave `expected` synchronised processes; every rank's pid for the pipeline."""
    world = accelerator.num_processes
    if world != expected or not dist.is_initialized():
        raise RuntimeError(
            f"accelerate started unsynchronised processes (this one sees {world} of {expected}): each would train "
            "alone; launch with --multi_gpu and ACCELERATE_USE_CPU=1 on CPU"
        )
    ones = torch.ones(1, device=accelerator.device)
    dist.all_reduce(ones)
    assert int(ones.item()) == expected, f"all_reduce over {expected} ranks gave {ones.item()}"
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return {"world": world, "pids": pids, "backend": dist.get_backend()}


def _record_failure(update_dir: Path, rank: int, error: BaseException) -> None:
    write_json(
        update_dir / f"rank-{rank}.error.json",
        {
            "rank": rank,
            "pid": os.getpid(),
            "time": time.time(),
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        },
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="host:port of the pipeline's listener")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--processes", type=int, required=True, help="ranks the pipeline asked for")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    update_dir = run_dir / "update"
    threads = int(os.environ.get("FORGEWEAVE_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    accelerator = make_accelerator(timeout=COMMAND_WAIT)
    try:
        hello = _hello(accelerator, args.processes)
        worker = Worker(load_yaml(update_dir / "config.yaml"), run_dir, accelerator)
        conn = None
        if accelerator.process_index == 0:
            host, port = args.connect.rsplit(":", 1)
            conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["FORGEWEAVE_TRAINER_AUTHKEY"]))
            conn.send(hello)
        serve(worker, conn)
        dist.destroy_process_group()
    except BaseException as e:
        _record_failure(update_dir, accelerator.process_index, e)
        traceback.print_exc()
        if isinstance(e, (EOFError, ConnectionError)) and accelerator.process_index == 0:
            _remove_publications(run_dir)  # the pipeline died: nobody else will free /dev/shm
        _exit(1)
    print(json.dumps({"rank": accelerator.process_index, "stopped": True}), flush=True)
    _exit(0)


def _remove_publications(run_dir: Path) -> None:
    directory = publication_dir(run_dir)
    if directory.name.startswith("forgeweave-"):  # the run's own RAM directory, not run_dir/weights
        shutil.rmtree(directory, ignore_errors=True)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown, which was seen to hang for minutes after a gloo group was used;
    everything this process wrote is already on disk (atomic writes) or flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
