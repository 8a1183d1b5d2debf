"""The checkpoint of a DDP update (two ranks, gloo on CPU): every rank holds the same weights and AdamW moments, so
only rank 0 copies them to host and writes them (issue 45: the async save copied model and optimizer on every
rank). The checkpoint still restores exactly: one process resumed from it holds rank 0's weights and moments and
takes the same next step as the two ranks did."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from forge import checkpoint as ckpt_mod
from forge.models import build_char_tokenizer, build_tiny_model
from tests.grpo_parts import TrainerWorker
from tests.test_trainer import make_batch, make_cfg


def _worker(rank: int, world: int, port: int, tok):
    cfg = make_cfg(strategy="ddp")
    cfg.checkpoint.async_save = True
    return TrainerWorker(cfg, model=build_tiny_model(tok, hidden=32, layers=2, seed=0), tokenizer=tok, rank=rank,
                         world=world, master_addr="127.0.0.1", master_port=port)  # fmt: skip


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    copied = {"tensors": 0}
    real = ckpt_mod.host_copy

    def counting(tensors):
        copied["tensors"] += len(tensors)
        return real(tensors)

    ckpt_mod.host_copy = counting
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    w = _worker(rank, 2, port, tok)
    batch = make_batch(tok)
    w.step(*batch)
    w.save(out, 1, {"sampler": {}}, None)
    w.wait_saved()
    stats = w.step(*batch)  # the step after the checkpoint, to compare a resumed process's with
    if rank == 0:
        Path(out, "ranks.json").write_text(json.dumps({"loss": stats.loss, "grad_norm": stats.grad_norm}))
        torch.save(w.trainer.unwrapped.state_dict(), Path(out, "after.pt"))  # weights after it: AdamW's moments count
    Path(out, f"copied-{rank}.json").write_text(json.dumps(copied))
    w.close()


def test_only_rank_0_copies_the_ddp_state_and_the_checkpoint_restores_exactly(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    copied = [json.loads((tmp_path / f"copied-{r}.json").read_text())["tensors"] for r in (0, 1)]
    assert copied[0] > 0 and copied[1] == 0, copied  # rank 1 copied nothing to host
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # one process here, whatever an earlier test left in the environment
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    one = _worker(0, 1, 0, tok)
    one.restore(str(tmp_path / "step-000001"))
    stats = one.step(*make_batch(tok))  # the step the two ranks took after the checkpoint, from the restored state
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    # the loss is ~0 (the advantages sum to 0); the gradient norm is not
    assert abs(stats.loss - ranks["loss"]) < 1e-6 and stats.grad_norm == pytest.approx(ranks["grad_norm"], rel=1e-4)
    after = torch.load(tmp_path / "after.pt")  # weights and AdamW moments restored: the same update
    got = one.trainer.unwrapped.state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in after.items()) < 1e-5
