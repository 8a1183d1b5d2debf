"""FSDP ranks other than 0 never load the policy's weights: they build it on the meta device and receive their
shards (and the buffers no state dict holds, e.g. rotary frequencies) from rank 0.

Two processes (gloo on CPU) each start a `TrainerWorker` with `update.strategy=fsdp` and no model given, so each
loads the policy itself (the tiny random Llama, built from the run seed). Rank 1 must ask for no weights, and after
one update both ranks' full weights and the loss must equal those of a 2-rank trainer whose ranks both built the
model (the path before this change): same values, same float ops, so compared exactly.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import forge.workers as workers
from forge.models import load_policy
from tests.grpo_parts import Trainer, TrainerWorker
from tests.test_trainer import make_batch, make_cfg


def _rank(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    asked = []

    def spy(cfg, seed=0, weights=True, **kwargs):
        asked.append(weights)
        return load_policy(cfg, seed=seed, weights=weights, **kwargs)

    workers.load_policy = spy  # this spawned process only
    cfg = make_cfg(strategy="fsdp")
    w = TrainerWorker(cfg, rank=rank, world=2, master_addr="127.0.0.1", master_port=port)
    stats = w.trainer.update(*make_batch(w.tokenizer))
    meta_loaded = w.weights()
    both, _ = load_policy(cfg.model, seed=cfg.seed)  # every rank builds the weights: the old path
    baseline = Trainer(both, cfg, 1, accelerator=w.trainer.accelerator)
    base_stats = baseline.update(*make_batch(w.tokenizer))
    base_weights = baseline.full_weights()
    if rank == 0:
        save_file(meta_loaded, Path(root) / "rank0_load.safetensors")
        save_file(base_weights, Path(root) / "all_load.safetensors")
    Path(root, f"rank{rank}.json").write_text(json.dumps({"asked": asked, "loss": stats.loss,
                                                          "base_loss": base_stats.loss}))  # fmt: skip
    w.close()


def test_only_rank_0_loads_weights_and_training_is_unchanged(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["asked"] == [True] and r1["asked"] == [False]
    assert r0["loss"] == r0["base_loss"] and r1["loss"] == r1["base_loss"]
    a, b = load_file(tmp_path / "rank0_load.safetensors"), load_file(tmp_path / "all_load.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
