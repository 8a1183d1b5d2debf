"""Tests for forge.trainer: log-prob gathering (ratio 1, positions, completion-only logits) and Trainer.update.

A tiny 1-layer Llama with the character tokenizer; Rollouts built by hand: N = 6 completions (B = 3 prompts of
different lengths, G = 2), prompts left-padded, completions right-padded to T = 4 with an eos in some rows.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import NamedTuple

import pytest
import torch

from forge.advantages import group_advantages
from forge.config import RunConfig
from forge.losses import StepTotals
from forge.models import build_tiny_model
from forge.recipes import grpo
from forge.recipes.grpo import grpo_loss
from forge.records import SAMPLES_PER_STEP, Rollouts
from forge.trainer import token_logprobs
from tests.grpo_parts import Trainer

torch.set_num_threads(1)

PROMPTS = ["1+2=", "10+20=", "7*8="]
COMPLETIONS = [("3", True), ("4", False), ("30", True), ("3000", False), ("56", False), ("5", True)]  # (text, eos)
T = 4


@pytest.fixture()
def model(tok):
    return build_tiny_model(tok, hidden=32, layers=1, seed=0)


def make_rollouts(tok) -> Rollouts:
    prompts = [p for p in PROMPTS for _ in range(2)]  # [N], row i belongs to prompt i // G
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    rows, masks = [], []
    for text, eos in COMPLETIONS:
        ids = tok(text)["input_ids"] + ([tok.eos_token_id] if eos else [])
        ids = ids[:T]
        rows.append(ids + [tok.pad_token_id] * (T - len(ids)))
        masks.append([1] * len(ids) + [0] * (T - len(ids)))
    completion_mask = torch.tensor(masks)  # [N, T]
    return Rollouts(
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],  # [N, P]
        completion_ids=torch.tensor(rows),
        completion_mask=completion_mask,  # [N, T]
        sampling_logprobs=torch.zeros(len(rows), T),
        texts=[c for c, _ in COMPLETIONS],
        finish_reasons=["stop" if eos else "length" for _, eos in COMPLETIONS],
        group_size=2,
        policy_version=0,
        prompts=prompts,
    )


class Batch(NamedTuple):
    """What an update takes: the rollouts and their advantages (`trainer.update(*batch)`)."""

    rollouts: Rollouts
    advantages: torch.Tensor  # [N]


def make_batch(tok) -> Batch:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    return Batch(make_rollouts(tok), group_advantages(rewards, 2, "zscore"))


def make_cfg(**update) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = T
    cfg.update.adaptive.enabled = False
    cfg.update.max_grad_norm = 0.0
    for k, v in update.items():
        if k == "adaptive":  # the controller on or off: update.adaptive.enabled
            cfg.update.adaptive.enabled = v
        else:
            setattr(cfg.update, k, v)
    return cfg


def logprobs(model, ro: Rollouts, **kw) -> torch.Tensor:
    return token_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, **kw).logp


def test_rollouts_fixture_has_left_padded_prompts_and_an_eos(tok):
    ro = make_rollouts(tok)
    assert ro.prompt_mask[0].tolist() == [0, 0, 1, 1, 1, 1]  # "1+2=" padded on the left to "10+20="'s 6 tokens
    assert ro.completion_ids[0].tolist()[:2] == [tok("3")["input_ids"][0], tok.eos_token_id]
    assert ro.completion_mask.sum(1).tolist() == [2, 1, 3, 4, 2, 2]


# ---------------------------------------------------------------- (a) ratio exactly 1 on the first pass


def test_logprobs_are_deterministic_so_first_ratio_is_exactly_one(tok, model):
    ro = make_rollouts(tok)
    first = logprobs(model, ro)
    with torch.no_grad():
        second = logprobs(model, ro)
    assert torch.equal(first.detach(), second)
    m = ro.completion_mask.bool()
    assert (first[m] < 0).all()

    # with old = logp.detach() the ratio is 1: no clipping, zero approx KL, loss = -aggregated advantage
    adv = torch.tensor([1.0, -1.0, 0.5, 0.5, 2.0, -2.0])
    totals = StepTotals(sequences=6, tokens=int(m.sum()), max_len=T)
    out = grpo_loss(first, first.detach(), adv, ro.completion_mask, algo=make_cfg().algo, totals=totals)
    assert not out.clipped_low.any() and not out.clipped_high.any()
    assert torch.equal(out.kl_old, torch.zeros_like(out.kl_old)) and out.kl_ref is None
    # grpo: every token's L = -A_i, so each sequence mean is -A_i and the loss is -mean(A) = -(1/6)
    assert out.loss.item() == pytest.approx(-1 / 6, abs=1e-7)
    # dapo (token mean), lengths [2, 1, 3, 4, 2, 2]: -(2*1 - 1 + 3*0.5 + 4*0.5 + 2*2 - 2*2) / 14 = -4.5 / 14
    cfg = make_cfg()
    cfg.algo.loss = "dapo"
    out = grpo_loss(first, first.detach(), adv, ro.completion_mask, algo=cfg.algo, totals=totals)
    assert out.loss.item() == pytest.approx(-4.5 / 14, abs=1e-7)


def test_trainer_first_pass_has_ratio_one(tok, model, monkeypatch):
    seen = []

    def spy(logp, old_logp, *args, **kwargs):
        seen.append(torch.equal(logp.detach(), old_logp))
        return grpo_loss(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    cfg = make_cfg(num_iterations=2, micro_batch_size=4, lr=1e-4)
    stats = Trainer(model, cfg, total_steps=1).update(*make_batch(tok))
    assert seen == [True, True, False, False]  # 2 micro-batches x 2 passes: old == new only on pass 1
    assert stats.clip_frac_low == 0 and stats.clip_frac_high == 0
    assert math.isfinite(stats.kl_old) and stats.kl_old >= 0 and stats.kl_ref == 0.0


# ---------------------------------------------------------------- (b) positions, (c) completion-only logits


def gpt2_model(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # deterministic, like the tiny Llama
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)


# RoPE (Llama) only sees relative positions, so a uniform shift from left padding leaves its logits unchanged
# even with wrong position ids: the Llama case checks the padding mask, the GPT-2 case (learned absolute
# positions) checks that position ids start at 0 on the first real token.
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_left_padding_does_not_change_logprobs(tok, model, arch):
    model = model if arch == "llama" else gpt2_model(tok)
    ro = make_rollouts(tok)
    assert ro.prompt_mask[0, 0] == 0  # row 0's prompt is left-padded in the batch
    batched = logprobs(model, ro)
    one = tok([PROMPTS[0]], return_tensors="pt")
    alone = token_logprobs(
        model, one["input_ids"], one["attention_mask"], ro.completion_ids[:1], ro.completion_mask[:1]
    ).logp
    n = int(ro.completion_mask[0].sum())
    torch.testing.assert_close(batched[0, :n], alone[0, :n], rtol=0, atol=1e-5)


def test_temperature_divides_logits(tok, model):
    ro = make_rollouts(tok)
    hot = logprobs(model, ro, temperature=2.0)
    cold = logprobs(model, ro)
    assert not torch.allclose(hot, cold)


def test_completion_only_logits_give_same_logprobs(tok, model):
    ro = make_rollouts(tok)
    only = logprobs(model, ro, completion_only=True)
    full = logprobs(model, ro, completion_only=False)
    torch.testing.assert_close(only, full, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- (d) invariance to micro_batch_size


@pytest.mark.parametrize(
    "loss, beta, iters",
    [("grpo", 0.0, 1), ("dr_grpo", 0.0, 1), ("dapo", 0.0, 1), ("gspo", 0.0, 1), ("cispo", 0.0, 1), ("dapo", 0.1, 2)],
)
def test_update_is_invariant_to_micro_batch_size(tok, model, loss, beta, iters):
    batch = make_batch(tok)
    n = batch.rollouts.num_completions
    trainers = []
    for size in (n, 2):
        # lr 1e-4: weights move ~1e-4, far above the 1e-6 tolerance. AdamW's first step is ~lr * sign(g), which
        # amplifies fp32 rounding on near-zero grads (diffs ~6e-7 at lr 1e-3), and hides a uniform grad scale
        # error: the grads are compared too.
        cfg = make_cfg(micro_batch_size=size, num_iterations=iters, lr=1e-4)
        cfg.algo.loss, cfg.algo.beta = loss, beta
        policy = copy.deepcopy(model)
        ref = copy.deepcopy(model).eval().requires_grad_(False) if beta > 0 else None
        trainers.append(Trainer(policy, cfg, total_steps=1, ref_model=ref))
    stats = [t.update(*batch) for t in trainers]
    assert stats[0].loss == pytest.approx(stats[1].loss, abs=1e-6)
    assert stats[0].grad_norm == pytest.approx(stats[1].grad_norm, rel=1e-5)
    moved = max(
        (a - b).abs().max().item() for a, b in zip(trainers[0].unwrapped.parameters(), model.parameters(), strict=True)
    )
    assert moved > 5e-5  # the step did move the weights, by much more than the tolerance below
    for (name, a), (_, b) in zip(
        trainers[0].unwrapped.named_parameters(), trainers[1].unwrapped.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=f"grad of {name}")
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"param {name}")


# ---------------------------------------------------------------- (e) UpdateStats


def test_update_stats_are_finite_and_versioned(tok, model):
    batch = make_batch(tok)
    cfg = make_cfg(lr=3e-4, micro_batch_size=4)
    trainer = Trainer(model, cfg, total_steps=2)
    first = trainer.update(*batch)
    second = trainer.update(*batch)
    for s in (first, second):
        for name in (
            "loss",
            "kl_old",
            "kl_ref",
            "clip_frac_low",
            "clip_frac_high",
            "entropy",
            "grad_norm",
            "lr",
            "lr_scale",
            "seconds",
        ):
            assert math.isfinite(getattr(s, name)), name
        assert s.lr == pytest.approx(3e-4)
        assert s.lr_scale == 1.0
        assert s.tokens == int(batch.rollouts.completion_mask.sum()) == 14
        assert s.entropy > 0 and s.grad_norm > 0
        assert 0 <= s.clip_frac_low <= 1 and 0 <= s.clip_frac_high <= 1
    assert (first.policy_version, second.policy_version) == (1, 2)
    assert trainer.policy_version == 2 and trainer.step == 2
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


def test_logprob_diff_measures_the_sampler_gap_and_tis_reweights(tok, model):
    """The trainer compares its log-probs with the sampler's on every step (train/logprob_diff); with tis, tokens
    whose sampler log-prob is far below the trainer's get the capped weight (is_truncated_frac)."""
    batch = make_batch(tok)
    exact = token_logprobs(model, *_inputs(batch.rollouts)).logp.detach() * batch.rollouts.completion_mask
    on_policy = batch._replace(rollouts=dataclasses.replace(batch.rollouts, sampling_logprobs=exact))
    cfg = make_cfg(lr=1e-9, micro_batch_size=4)  # two micro-batches of their own widths: the gaps follow the rows
    stats = Trainer(copy.deepcopy(model), cfg, total_steps=1).update(*on_policy)
    assert stats.logprob_diff < 1e-6 and stats.is_truncated_frac == 0.0  # tis off: never counted
    # the sampler saw every token 1 nat less likely: |diff| = 1, weights e^1 > cap 2 -> all truncated
    shifted = dataclasses.replace(batch.rollouts, sampling_logprobs=(exact - 1.0) * batch.rollouts.completion_mask)
    off = batch._replace(rollouts=shifted)
    cfg = make_cfg(lr=1e-9)
    cfg.algo.is_correction = "tis"
    tis = Trainer(copy.deepcopy(model), cfg, total_steps=1).update(*off)
    assert tis.logprob_diff == pytest.approx(1.0, abs=1e-5) and tis.is_truncated_frac == 1.0
    # per token, for the token view: each of the first rows' gaps over its real tokens, 1 nat on every one of them
    lengths = batch.rollouts.completion_mask.sum(1).tolist()
    assert [len(g) for g in tis.logprob_gaps] == lengths[:SAMPLES_PER_STEP] and len(lengths) > 1
    assert all(x == pytest.approx(1.0, abs=1e-4) for g in tis.logprob_gaps for x in g)
    assert [len(g) for g in stats.logprob_gaps] == lengths[:SAMPLES_PER_STEP]
    assert max(abs(x) for g in stats.logprob_gaps for x in g) < 1e-4
    plain = Trainer(copy.deepcopy(model), make_cfg(lr=1e-9), total_steps=1).update(*off)
    assert tis.loss == pytest.approx(2.0 * plain.loss, rel=1e-5)  # every policy term weighted by the cap


def _inputs(ro: Rollouts):
    return ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
