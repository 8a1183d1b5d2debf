"""Persistent update ranks (gloo, CPU): one update on 2 ranks == one process with gradient accumulation.

The batch is the hand-built one of tests/test_trainer.py: N = 6 completions of different lengths (14 tokens),
with different advantages. Rank 0 trains on rows 0-2, rank 1 on rows 3-5 (micro-batches of 2), the reference
one-process Trainer on all 6 rows (micro-batches of 2): the loss is normalised by the step's global counts and
the gradients summed over ranks, so the parameters agree to float rounding (the 1e-5 bound is the issue's).
A rank that trained alone (the silent `accelerate launch --cpu` failure) would hold the weights of a one-process
update on its own 3 rows, which differ from the full update by ~lr: the tests check both that the ranks agree
with each other and that they moved away from that alone-trained result.
"""

from __future__ import annotations

import json

import pytest
import torch

from forge.checkpoint import save_checkpoint
from forge.config import RunConfig
from forge.distributed.remote import RemoteTrainer, TrainerProcessError, group_members, live_ranks
from forge.models import load_policy
from forge.records import ScoredBatch
from forge.trainer import Trainer
from tests.test_trainer import T, make_batch

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def make_cfg(strategy: str = "ddp") -> RunConfig:
    cfg = RunConfig(threads=1)
    cfg.model.tiny_hidden, cfg.model.tiny_layers = 32, 1
    cfg.rollout.max_new_tokens = T
    u = cfg.update
    u.adaptive, u.lr, u.micro_batch_size, u.num_processes, u.strategy = False, 1e-2, 2, 2, strategy
    return cfg


def rows(batch: ScoredBatch, sl: slice) -> ScoredBatch:
    """The batch restricted to some rows (what a rank that trained alone would have used)."""
    ro = batch.rollouts
    cut = {k: getattr(ro, k)[sl] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    ro = type(ro)(**{**ro.__dict__, **cut, "sampling_logprobs": ro.sampling_logprobs[sl]})
    return ScoredBatch(ro, batch.verifier_names, batch.scores[sl], batch.rewards[sl], batch.advantages[sl], {})


def one_process(cfg: RunConfig, batch: ScoredBatch, steps: int = 1) -> tuple[Trainer, list]:
    model, _ = load_policy(cfg.model, seed=cfg.seed)
    trainer = Trainer(model, cfg, total_steps=10)
    return trainer, [trainer.update(batch) for _ in range(steps)]


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.fixture
def tok():
    return load_policy(make_cfg().model)[1]


def test_two_ranks_equal_one_process_and_really_synchronise(tmp_path, tok):
    cfg, batch = make_cfg(), make_batch(tok)
    model, _ = load_policy(cfg.model, seed=cfg.seed)
    remote = RemoteTrainer(model, cfg, tmp_path / "run", processes=2)
    try:
        info = json.loads((tmp_path / "run" / "update" / "processes.json").read_text())
        assert info["backend"] == "gloo" and len(info["ranks"]) == 2
        stats = remote.update(batch)
        checksums = remote.rank_checksums()
        state = remote.state_dict()
    finally:
        remote.close()
    assert remote.proc.poll() is not None and not group_members(remote.proc.pid), "launcher left behind"
    assert len(remote.pids) == 2 and not live_ranks(remote.pids), "update ranks left behind"
    assert remote.policy_version == stats.policy_version == 1
    assert checksums[0] == checksums[1], "the ranks hold different weights: gradients were not averaged"

    ref, (ref_stats,) = one_process(cfg, batch)
    assert max_diff(remote.unwrapped, ref.unwrapped) <= 1e-5  # the rollout model got rank 0's new weights
    for k in ("loss", "kl", "entropy", "grad_norm"):  # summed over ranks: the same as one process
        assert getattr(stats, k) == pytest.approx(getattr(ref_stats, k), rel=1e-5, abs=1e-7), k
    assert stats.tokens == ref_stats.tokens == 14 and stats.sync_seconds > 0
    ref_state = ref.state_dict()
    for i, s in ref_state["optimizer"]["state"].items():
        torch.testing.assert_close(state["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=1e-6)

    alone, _ = one_process(cfg, rows(batch, slice(0, 3)))  # rank 0 training on its rows only
    assert max_diff(alone.unwrapped, ref.unwrapped) > 1e-3  # so the 1e-5 agreement above is not vacuous


def test_fsdp_two_ranks_equal_one_process_and_resume(tmp_path, tok):
    """FSDP2 full shard over gloo: same update as one process; a checkpoint written by one process resumes
    on the sharded ranks (full optimizer state scattered to the shards), and the next update agrees again."""
    cfg, batch = make_cfg("fsdp"), make_batch(tok)
    ref, _ = one_process(cfg, batch)
    ckpt = save_checkpoint(tmp_path / "ckpts", 1, ref.unwrapped, tok, {"trainer": ref.state_dict()})
    model, _ = load_policy(cfg.model, seed=cfg.seed)
    remote = RemoteTrainer(model, cfg, tmp_path / "run", processes=2)
    try:
        remote.update(batch)
        assert max_diff(remote.unwrapped, ref.unwrapped) <= 1e-5
        state = remote.state_dict()  # gathered from the shards, keyed like a plain optimizer's
        assert sorted(state["optimizer"]["state"]) == sorted(ref.state_dict()["optimizer"]["state"])
        remote.restore(ckpt, ref.state_dict())
        assert remote.policy_version == 1 and max_diff(remote.unwrapped, ref.unwrapped) == 0
        stats = remote.update(batch)
    finally:
        remote.close()
    ref_stats = ref.update(batch)
    assert stats.policy_version == ref_stats.policy_version == 2
    assert max_diff(remote.unwrapped, ref.unwrapped) <= 1e-5
    assert stats.grad_norm == pytest.approx(ref_stats.grad_norm, rel=1e-5)


def test_a_failed_call_names_the_rank_and_stops_all_processes(tmp_path, tok):
    cfg = make_cfg()
    model, _ = load_policy(cfg.model, seed=cfg.seed)
    remote = RemoteTrainer(model, cfg, tmp_path / "run", processes=2)
    try:
        with pytest.raises(TrainerProcessError, match=r"update rank [01] of 2 failed: FileNotFoundError"):
            remote.restore(tmp_path / "no-such-checkpoint", {"policy_version": 0})
        assert remote.proc.poll() is not None and not live_ranks(remote.pids)
        with pytest.raises(TrainerProcessError, match="rank"):  # a retry (Prefect) fails the same way at once
            remote.update(make_batch(tok))
    finally:
        remote.close()
