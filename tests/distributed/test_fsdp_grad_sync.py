"""FSDP2 gradient accumulation: gradients are reduce-scattered once per optimizer step, not per micro-batch.

Two processes (gloo on CPU) shard a 2-layer tiny Llama with `fully_shard` per decoder layer and at the root (3 FSDP
groups). With micro_batch_size=1 each rank's 3 rows are 3 micro-batches; `accelerator.no_sync` does nothing for
FSDP2 modules, so before the fix every micro-batch reduced: 3 groups x 3 micro-batches = 9 reduce-scatters. With
`set_requires_gradient_sync` only the last micro-batch reduces: 3 per step. The loss must not depend on it either:
it equals the run with one micro-batch per rank (micro_batch_size=3), which reduces once anyway.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from forge.models import build_char_tokenizer, build_tiny_model
from tests.grpo_parts import Trainer, TrainerWorker
from tests.test_trainer import make_batch, make_cfg


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    torch.set_num_threads(1)
    calls = {"n": 0}
    real = coll.DefaultReduceScatter.__call__

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return real(self, *args, **kwargs)

    coll.DefaultReduceScatter.__call__ = counting
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    w = TrainerWorker(make_cfg(strategy="fsdp"), model=build_tiny_model(tok, hidden=32, layers=2, seed=0),
                      tokenizer=tok, rank=rank, world=2, master_addr="127.0.0.1", master_port=port)  # fmt: skip
    result = {}
    for micro in (1, 3):  # the same group (the worker's accelerator), a fresh sharded model each time
        cfg = make_cfg(strategy="fsdp", micro_batch_size=micro)
        trainer = Trainer(build_tiny_model(tok, hidden=32, layers=2, seed=0), cfg, 1, accelerator=w.trainer.accelerator)
        calls["n"] = 0
        stats = trainer.update(*make_batch(tok))
        result[micro] = {"reduce_scatters": calls["n"], "loss": stats.loss, "grad_norm": stats.grad_norm}
    w.close()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def test_fsdp2_reduces_gradients_once_per_step(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.json"
    mp.spawn(_rank, args=(port, str(out)), nprocs=2)
    result = json.loads(out.read_text())
    assert result["1"]["reduce_scatters"] == 3  # 3 FSDP groups, once each, though 3 micro-batches
    assert result["3"]["reduce_scatters"] == 3
    assert abs(result["1"]["loss"] - result["3"]["loss"]) < 1e-6
    assert abs(result["1"]["grad_norm"] - result["3"]["grad_norm"]) < 1e-5 * max(1.0, result["3"]["grad_norm"])
