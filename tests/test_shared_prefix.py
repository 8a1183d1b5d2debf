"""Shared-prefix packing (forge/shared_prefix.py): the same log-probs, gradients and update as the plain forward.

A tiny 2-layer Llama with grouped-query attention and the character tokenizer. Rows: 3 prompts of different
lengths (left-padded) with groups of 3, 1 and 2 completions (a group of one, uneven groups), completions of
different lengths with an eos in some rows, right-padded to T = 5 (the packed row drops every padding token).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import forge.trainer as trainer_mod
from forge.config import RunConfig
from forge.models import build_tiny_model
from forge.records import Rollouts
from forge.shared_prefix import PackingCost, completion_lengths, group_spans, pack, pack_saves_compute, packed_length
from forge.trainer import token_logprobs
from tests.grpo_parts import Trainer

torch.set_num_threads(1)

T = 5
GROUPS = [("12+34=", ["46", "4", "460"]), ("7*8=", ["56"]), ("100-1=", ["99", "9999"])]
EOS = [True, False, True, False, True, False]


def tiny(tok, attn="sdpa"):
    model = build_tiny_model(tok, hidden=32, layers=2, seed=0, num_key_value_heads=1, attn_implementation=attn)
    return model.eval()


def rollouts(tok) -> Rollouts:
    prompts = [p for p, comps in GROUPS for _ in comps]
    texts = [c for _, comps in GROUPS for c in comps]
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    rows, masks = [], []
    for text, eos in zip(texts, EOS, strict=True):
        ids = (tok(text)["input_ids"] + ([tok.eos_token_id] if eos else []))[:T]
        rows.append(ids + [tok.pad_token_id] * (T - len(ids)))
        masks.append([1] * len(ids) + [0] * (T - len(ids)))
    return Rollouts(
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        completion_ids=torch.tensor(rows),
        completion_mask=torch.tensor(masks),
        sampling_logprobs=torch.zeros(len(rows), T),
        texts=texts,
        finish_reasons=["stop" if e else "length" for e in EOS],
        group_size=1,
        policy_version=0,
        prompts=prompts,
    )


def logprobs(model, ro: Rollouts, packing):
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    return token_logprobs(model, *args, temperature=0.7, packing=packing).logp  # [n, T]


def test_groups_are_runs_of_identical_prompts(tok):
    ro = rollouts(tok)
    assert group_spans(ro.prompt_ids, ro.prompt_mask) == [(0, 3), (3, 4), (4, 6)]


def test_packed_row_holds_each_prompt_once_and_no_padding(tok):
    ro = rollouts(tok)
    spans = group_spans(ro.prompt_ids, ro.prompt_mask)
    packed = pack(ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, spans)
    prompts = [p for p, _ in GROUPS]
    lengths = ro.completion_mask.sum(1).tolist()  # [3, 1, 4, 3, 3, 5]: "46"+eos, "4", "460"+eos, ...
    assert completion_lengths(ro.completion_mask).tolist() == lengths
    assert packed.input_ids.shape == (1, sum(map(len, prompts)) + sum(lengths))
    assert packed_length(ro.prompt_mask, completion_lengths(ro.completion_mask), spans) == packed.input_ids.shape[1]
    p0, c0 = len(prompts[0]), lengths[0]
    row = packed.input_ids[0]
    assert torch.equal(row[:p0], ro.prompt_ids[0, -p0:])  # group 0's real prompt tokens, no left padding
    assert torch.equal(row[p0 : p0 + c0], ro.completion_ids[0, :c0])
    assert torch.equal(row[p0 + c0 : p0 + c0 + lengths[1]], ro.completion_ids[1, : lengths[1]])
    # completion 1's first token is predicted from the prompt's last position, its next ones from its own tokens
    assert packed.keep[:c0].tolist() == [p0 - 1, p0, p0 + 1]
    assert packed.keep[c0].item() == p0 - 1
    assert torch.equal(packed.targets[0], ro.completion_ids[ro.completion_mask.bool()])
    mask = packed.attention[0, 0]
    q = p0 + c0  # completion 1's first token sees group 0's prompt and itself, not completion 0
    assert mask[q, :p0].all() and not mask[q, p0:q].any() and mask[q, q] and not mask[q, q + 1 :].any()
    g1 = p0 + sum(lengths[:3])  # group 1's prompt sees none of group 0
    assert not mask[g1, :g1].any() and mask[g1, g1]
    # positions restart after the prompt in every completion, and at 0 in every prompt
    assert packed.position_ids[0, p0 : p0 + 2].tolist() == [p0, p0 + 1]
    assert packed.position_ids[0, q : q + 1].tolist() == [p0]
    assert packed.position_ids[0, g1] == 0


def test_a_masked_token_inside_a_completion_stays_context_but_no_key(tok, packed_calls):
    """A hole in the completion mask (a tool's output, say) is kept in the row as the plain forward keeps it: no key
    for later tokens, positions not advanced; the tokens after it get the plain log-probs."""
    ro = rollouts(tok)
    mask = ro.completion_mask.clone()
    mask[2, 1] = 0  # "460"+eos: the "6" is masked, "0" and eos still count
    ro = dataclasses.replace(ro, completion_mask=mask)
    model = tiny(tok)
    with torch.no_grad():
        plain, packed = logprobs(model, ro, None), logprobs(model, ro, PackingCost.of(model))
    assert len(packed_calls) == 1
    assert torch.allclose(packed[mask.bool()], plain[mask.bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_plain_forward(tok, attn, packed_calls):
    ro = rollouts(tok)
    m = ro.completion_mask.bool()
    weights = torch.linspace(-1.0, 1.0, ro.completion_ids.numel()).reshape(ro.completion_ids.shape)
    grads = {}
    for packed in (False, True):
        model = tiny(tok, attn)
        cost = PackingCost.of(model)
        assert cost is not None and cost.mask_kind == ("bool" if attn == "sdpa" else "additive")
        logp = logprobs(model, ro, cost if packed else None)
        (logp * weights * m).sum().backward()
        grads[packed] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert len(packed_calls) == 1
    plain_logp, plain_grads = grads[False]
    packed_logp, packed_grads = grads[True]
    assert torch.allclose(packed_logp[m], plain_logp[m], atol=1e-5, rtol=0)
    for name, g in plain_grads.items():
        assert torch.allclose(packed_grads[name], g, atol=1e-6, rtol=1e-4), name
    assert sum(g.abs().sum() for g in plain_grads.values()) > 0


def test_a_trainer_step_is_the_same_packed_or_plain(tok, packed_calls):
    """Micro-batches of 4 rows split the first group's 3 and the last group's 2 rows across micro-batches."""
    ro = rollouts(tok)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0])
    advantages = rewards - 0.5
    base = tiny(tok)
    results = {}
    for shared in (False, True):
        cfg = RunConfig()
        cfg.rollout.max_new_tokens, cfg.rollout.temperature = T, 0.7
        cfg.update.micro_batch_size, cfg.update.lr, cfg.update.shared_prefix = 4, 1e-2, shared
        cfg.algo.loss = "dapo"
        trainer = Trainer(copy.deepcopy(base).train(), cfg, total_steps=2)
        assert (trainer.packing is not None) is shared
        stats = [trainer.update(ro, advantages) for _ in range(2)]
        results[shared] = (stats, {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()})
    assert len(packed_calls) == 2 * 2  # two micro-batches (rows 0-3, 4-5) in each of the two packed steps
    (plain_stats, plain_w), (packed_stats, packed_w) = results[False], results[True]
    for a, b in zip(plain_stats, packed_stats, strict=True):
        assert b.loss == pytest.approx(a.loss, abs=1e-6)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert b.entropy == pytest.approx(a.entropy, rel=1e-5)
    assert plain_stats[1].entropy != plain_stats[0].entropy  # the first step moved the weights (loss: ratio 1)
    for name, w in plain_w.items():
        # Adam divides each gradient element by its own scale, so rounding on a near-zero gradient can move a
        # weight by a visible share of the LR: measured at most 6.4e-6 here, i.e. 0.06% of one step of lr 1e-2
        assert (packed_w[name] - w).abs().max() <= 1e-3 * 1e-2, name


def test_packing_is_used_only_where_it_saves_flops():
    # per_token 1000, per_pair 1: plain n*(L*1000 + L*L), packed L'*1000 + L'^2
    cost = PackingCost(per_token=1000.0, per_pair=1.0, mask_kind="bool")
    # a group of 8, prompt 50, completions 32: plain 8*(82*1000 + 82^2) = 709,792; packed 306*1000 + 306^2 = 399,636
    assert pack_saves_compute(cost, rows=8, padded_len=82, packed_len=50 + 8 * 32)
    # prompt 10, completions 1000: plain 8*(1010*1000 + 1010^2) = 16.2M; packed 8010*1000 + 8010^2 = 72.2M
    assert not pack_saves_compute(cost, rows=8, padded_len=1010, packed_len=10 + 8 * 1000)
    # rows that share no prompt and have no padding: packing cannot save anything
    assert not pack_saves_compute(cost, rows=8, padded_len=82, packed_len=8 * 82)
    # ... but with padding it can: 8 rows of 82 padded, 8 * 41 real tokens
    assert pack_saves_compute(cost, rows=8, padded_len=82, packed_len=8 * 41)


def test_kernels_without_a_4d_mask_are_not_packed(tok):
    model = tiny(tok)
    model.config._attn_implementation = "flash_attention_2"
    assert PackingCost.of(model) is None


@pytest.fixture()
def packed_calls(monkeypatch):
    """How many forwards took the packed path."""
    calls = []
    real = trainer_mod.packed_logits

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "packed_logits", spy)
    return calls


@pytest.mark.parametrize("window", [4, 64])
def test_a_sliding_window_is_packed_only_where_the_whole_context_fits_in_it(tok, window, packed_calls):
    """The packed mask is full attention: a window shorter than prompt + completion (4 here) must run plain."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=window,
                           attn_implementation="sdpa", pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    ro = rollouts(tok)
    cost = dataclasses.replace(PackingCost.of(model), per_pair=0.0)  # attention free: the FLOP gate always packs
    assert cost.window == window and cost.fits(ro.prompt_ids.shape[1] + T) is (window == 64)
    m = ro.completion_mask.bool()
    with torch.no_grad():
        plain, packed = logprobs(model, ro, None), logprobs(model, ro, cost)
    assert len(packed_calls) == (window == 64)
    assert torch.allclose(packed[m], plain[m], atol=1e-5, rtol=0)
    if window == 4:  # the plain forward itself: bit for bit
        assert torch.equal(packed, plain)


def test_chunked_attention_layers_are_not_packed(tok):
    model = tiny(tok)
    model.config.layer_types = ["chunked_attention", "full_attention"]
    assert PackingCost.of(model) is None


def test_packed_teacher_token_logprobs_and_gradients_equal_the_plain_forward(tok, packed_calls):
    """The log-probs of other tokens at each completion position (a distillation teacher's top k,
    `TokenLogprobs.extra`), and the gradient through them, are those of the plain forward."""
    ro = rollouts(tok)
    m = ro.completion_mask.bool()
    extra_ids = torch.randint(0, len(tok), (*ro.completion_ids.shape, 4), generator=torch.Generator().manual_seed(0))
    weights = torch.linspace(-1.0, 1.0, extra_ids.numel()).reshape(extra_ids.shape)
    got = {}
    for packed in (False, True):
        model = tiny(tok)
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        out = token_logprobs(model, *args, temperature=0.7, packing=PackingCost.of(model) if packed else None,
                             extra_ids=extra_ids)  # fmt: skip
        assert out.extra.shape == extra_ids.shape
        (out.extra * weights * m[..., None]).sum().backward()
        got[packed] = (out.extra.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert len(packed_calls) == 1
    (plain, plain_grads), (packed, packed_grads) = got[False], got[True]
    assert torch.allclose(packed[m], plain[m], atol=1e-5, rtol=0)
    assert torch.equal(packed[~m], torch.zeros_like(packed[~m]))  # padding: nothing computed, nothing trained
    for name, g in plain_grads.items():
        assert torch.allclose(packed_grads[name], g, atol=1e-6, rtol=1e-4), name
