"""FSDP ranks other than 0 never load the policy's weights: they build it on the meta device and receive their
shards (and the buffers no state dict holds, e.g. rotary frequencies) from rank 0; and no rank, rank 0 included,
ever places the whole model on its device: every rank shards a meta skeleton and allocates only its own shards
(issue 31, FSDP start-up). The reference model (algo.beta > 0) is sharded the same way.

Two processes (gloo on CPU) each start a `TrainerWorker` with `update.strategy=fsdp`, `algo.beta > 0` and no model
given, so each loads the policy itself (the tiny random Llama, built from the run seed). Rank 1 must ask for no
weights, every model `fsdp.shard` is given must be on the meta device, the reference model's parameters must be
shards, and after two updates both ranks' full weights, the loss and the KL must equal those of a 2-rank trainer
whose ranks both built the model and a full reference copy (the path before this change): same values, same float
ops, so compared exactly. Then each rank sends its weights through an ipc weight group of its own (colocated mode on
several GPUs: each rank feeds the engines on its GPU), and what each group's receiver gets is the full weights.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

import forge.workers as workers
from forge.distributed import fsdp
from forge.models import load_policy
from forge.weight_group import WeightGroup
from tests.grpo_parts import Trainer, TrainerWorker
from tests.test_trainer import make_batch, make_cfg


def _rank(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    asked = []

    def spy(cfg, seed=0, weights=True, **kwargs):
        asked.append(weights)
        return load_policy(cfg, seed=seed, weights=weights, **kwargs)

    sharded_on_meta, shard = [], fsdp.shard

    def shard_spy(model, *args, **kwargs):
        sharded_on_meta.append(all(p.is_meta for p in model.parameters()))
        return shard(model, *args, **kwargs)

    workers.load_policy, fsdp.shard = spy, shard_spy  # this spawned process only
    cfg = make_cfg(strategy="fsdp")
    cfg.algo.beta = 0.1
    w = TrainerWorker(cfg, rank=rank, world=2, master_addr="127.0.0.1", master_port=port)
    fsdp.shard = shard
    ref_sharded = all(isinstance(p, DTensor) for p in w.trainer.ref_model.parameters())
    stats = [w.trainer.update(*make_batch(w.tokenizer)) for _ in range(2)][-1]  # the 2nd: a KL to the reference
    meta_loaded = w.weights()
    both, _ = load_policy(cfg.model, seed=cfg.seed)  # every rank builds the weights: the old path
    baseline = Trainer(both, cfg, 1, ref_model=copy.deepcopy(both).requires_grad_(False),
                       accelerator=w.trainer.accelerator)  # fmt: skip
    base_stats = [baseline.update(*make_batch(w.tokenizer)) for _ in range(2)][-1]
    base_weights = baseline.full_weights()
    received = _through_own_ipc_group(w)
    if rank == 0:
        save_file(meta_loaded, Path(root) / "rank0_load.safetensors")
        save_file(base_weights, Path(root) / "all_load.safetensors")
    Path(root, f"rank{rank}.json").write_text(json.dumps({
        "asked": asked, "on_meta": sharded_on_meta, "ref_sharded": ref_sharded, "loss": stats.loss,
        "base_loss": base_stats.loss, "kl": stats.kl_ref, "base_kl": base_stats.kl_ref}))  # fmt: skip
    save_file(received, Path(root) / f"ipc{rank}.safetensors")
    w.close()


def _through_own_ipc_group(w) -> dict[str, torch.Tensor]:
    """Colocated on several GPUs, each rank hosts an ipc weight group for the engines on its own GPU: this rank hosts
    one and a thread of this process joins it as its engine; the rank's `send_weights` (its `publish_tensors`, a
    gather per parameter on both ranks at once) goes through it. Returns what the thread received."""
    plan, port = w.host_weight_group("127.0.0.1", 2, "ipc")
    got: dict[str, torch.Tensor] = {}

    def engine() -> None:
        g = WeightGroup(1, 2, "ipc")
        g.connect("127.0.0.1", port)
        g.receive(plan, lambda pairs: got.update((k, v.clone()) for k, v in pairs))

    t = threading.Thread(target=engine)
    t.start()
    w.connect_weight_group("127.0.0.1", port)
    w.send_weights()
    t.join()
    return got


def test_only_rank_0_loads_weights_and_training_is_unchanged(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["asked"] == [True] and r1["asked"] == [False]
    assert r0["on_meta"] == r1["on_meta"] == [True, True]  # policy and reference: no rank placed the whole model
    assert r0["ref_sharded"] and r1["ref_sharded"]
    assert r0["loss"] == r0["base_loss"] and r1["loss"] == r1["base_loss"]
    assert r0["kl"] == r0["base_kl"] and r1["kl"] == r1["base_kl"] and r0["kl"] != 0
    a, b = load_file(tmp_path / "rank0_load.safetensors"), load_file(tmp_path / "all_load.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # each rank's own ipc group carried the full, current weights (a tied copy once), rank 1's as well as rank 0's
    for r in (0, 1):
        got = load_file(tmp_path / f"ipc{r}.safetensors")
        assert got and set(a) - set(got) <= {"lm_head.weight"} and all(torch.equal(got[k], a[k]) for k in got)
