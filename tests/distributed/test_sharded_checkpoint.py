"""Sharded checkpoints of a 2-rank FSDP update, resumed into 2 ranks and into 1 process.

Two processes (torch.multiprocessing, gloo on CPU) each run a `TrainerWorker` rank (FSDP2 full shard of a 2-layer
tiny Llama) on the hand-built batch of tests/test_trainer.py: 2 updates, an asynchronous save (each rank writes
its own shard on the checkpoint group, in the background), 2 more updates = the uninterrupted run. Then, in the
same processes, a fresh 2-rank trainer restores the step-2 checkpoint and does the 2 updates again; and this
test's process restores it into one process and does them too. The 2-rank resume repeats the same float ops, so
it is checked at 1e-6; one process sums the same per-row gradients in another order, so at 1e-4 relative, the
tolerance of the other 1-rank vs 2-rank comparisons (tests/flows/test_ray_exec.py).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from forge.checkpoint import export_model, load_state, shard_keys
from forge.models import build_char_tokenizer, build_tiny_model
from tests.grpo_parts import Trainer, TrainerWorker
from tests.test_trainer import make_batch, make_cfg

STEPS = 4


def _tok():
    t = build_char_tokenizer()
    t.padding_side = "left"
    return t


def _cfg():
    cfg = make_cfg(adaptive=True, max_grad_norm=1.0, strategy="fsdp")
    cfg.steps = STEPS
    return cfg


def _train(trainer: Trainer, tok, steps: int) -> list[float]:
    return [trainer.update(*make_batch(tok)).loss for _ in range(steps)]


def _rank(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    tok, cfg = _tok(), _cfg()
    model = build_tiny_model(tok, hidden=32, layers=2, seed=0)
    w = TrainerWorker(cfg, model=model, tokenizer=tok, rank=rank, world=2, master_addr="127.0.0.1",
                      master_port=port)  # fmt: skip
    losses = _train(w.trainer, tok, 2)
    w.save(root, 2, {"note": "fsdp"}, None)  # asynchronous: the next updates run while it is written
    losses += _train(w.trainer, tok, 2)
    assert (w.wait_saved() is not None) == (rank == 0)
    straight = w.weights()
    fresh = Trainer(build_tiny_model(tok, hidden=32, layers=2, seed=1), cfg, STEPS, accelerator=w.trainer.accelerator)
    ckpt = Path(root) / "step-000002"
    fresh.restore(ckpt, load_state(ckpt)["trainer"])
    resumed = _train(fresh, tok, 2)
    resumed_weights = fresh.full_weights()
    if rank == 0:
        save_file(straight, Path(root) / "straight.safetensors")
        save_file(resumed_weights, Path(root) / "resumed2.safetensors")
        (Path(root) / "losses.json").write_text(json.dumps({"straight": losses, "resumed2": resumed}))
    w.close()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp") / "checkpoints"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(root)), nprocs=2)
    return root


def test_each_rank_wrote_its_own_shard(fsdp_run):
    ckpt = fsdp_run / "step-000002"
    shards = sorted(p.name for p in (ckpt / "state").glob("*.safetensors"))
    assert len(shards) == 2 and not (ckpt / "model.safetensors").exists()  # nothing gathered to rank 0
    keys = shard_keys(ckpt)
    assert "model.model.embed_tokens.weight" in keys and "optim.model.embed_tokens.weight.exp_avg" in keys
    assert "model.lm_head.weight" not in keys  # tied to the embedding: stored once
    assert json.loads((ckpt / "checkpoint.json").read_text())["ranks"] == 2
    assert load_state(ckpt)["note"] == "fsdp" and load_state(ckpt)["trainer"]["step"] == 2


def test_resume_into_two_ranks_continues_exactly(fsdp_run):
    losses = json.loads((fsdp_run / "losses.json").read_text())
    assert losses["resumed2"] == pytest.approx(losses["straight"][2:], rel=1e-6, abs=1e-9)
    a, b = load_file(fsdp_run / "straight.safetensors"), load_file(fsdp_run / "resumed2.safetensors")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_resume_into_one_process_continues_as_the_two_rank_run(fsdp_run):
    torch.set_num_threads(1)
    tok, cfg = _tok(), _cfg()
    trainer = Trainer(build_tiny_model(tok, hidden=32, layers=2, seed=1), cfg, STEPS)
    ckpt = fsdp_run / "step-000002"
    trainer.restore(ckpt, load_state(ckpt)["trainer"])
    assert trainer.step == 2 and trainer.policy_version == 2
    losses = json.loads((fsdp_run / "losses.json").read_text())
    assert _train(trainer, tok, 2) == pytest.approx(losses["straight"][2:], rel=1e-4, abs=1e-6)
    want, got = load_file(fsdp_run / "straight.safetensors"), trainer.full_weights()
    assert max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-4


def test_export_writes_the_hf_weights_of_a_sharded_checkpoint(fsdp_run, tmp_path):
    """The HF directory of a sharded checkpoint, assembled in this process: the model loads from it."""
    ckpt = fsdp_run / "step-000002"
    out = export_model(ckpt, tmp_path / "hf")
    tok = _tok()
    model = build_tiny_model(tok, hidden=32, layers=2, seed=1)
    trainer = Trainer(model, _cfg(), STEPS)
    trainer.restore(ckpt, load_state(ckpt)["trainer"])  # the weights from the shards
    exported = load_file(out)
    assert "lm_head.weight" not in exported  # tied: HF leaves it out and re-ties on load
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items() if k in exported)
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
