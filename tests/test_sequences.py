"""An episode of several training sequences (forge/sequences.py; agent episodes whose history was rewritten): the
further sequences join the update with their episode's advantage, and the normalisers count the episode once.

The check that can tell: an episode split where its second sequence's prompt is exactly the first's prompt and
tokens so far (the same context for every sampled token) must train exactly as the unsplit episode, for every
normaliser. Counting each sequence as one (the naive way) gives a different loss under the sequence mean.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from forge.config import RunConfig
from forge.models import build_char_tokenizer, build_tiny_model
from forge.records import Episodes, Rollouts, TokenSequence
from forge.sequences import training_rows
from tests.grpo_parts import Trainer

torch.set_num_threads(1)

PROMPT, FIRST, TOOL, SECOND = "3+4=", "ab", "<t=7>", "cd"  # sampled, tool (loss 0), sampled + eos


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer()
    t.padding_side = "left"
    return t


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden=32, layers=2, seed=0, attn_implementation="sdpa")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def rollouts(tok, rows: list[tuple[list[int], list[int], list[int]]], more: list[list[TokenSequence]]) -> Rollouts:
    """One group of len(rows) episodes (prompt ids, ids, loss), log-prob -1 on the sampled tokens."""
    n, P, T = len(rows), max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    left = lambda xs, w: [tok.pad_token_id] * (w - len(xs)) + xs  # noqa: E731
    right = lambda xs, w, fill: xs + [fill] * (w - len(xs))  # noqa: E731
    eps = Episodes([1] * n, [0] * n, [0] * n, [False] * n, [0.0] * n, [[0]] * n, [[]] * n, more_sequences=more)
    return Rollouts(
        prompt_ids=torch.tensor([left(p, P) for p, _, _ in rows]),
        prompt_mask=torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _, _ in rows]),
        completion_ids=torch.tensor([right(c, T, tok.pad_token_id) for _, c, _ in rows]),
        completion_mask=torch.tensor([right([1] * len(c), T, 0) for _, c, _ in rows]),
        sampling_logprobs=torch.tensor([right([-1.0 * x for x in m], T, 0.0) for _, _, m in rows]),
        texts=[""] * n,
        finish_reasons=["stop"] * n,
        group_size=n,
        policy_version=0,
        loss_mask=torch.tensor([right(m, T, 0) for _, _, m in rows]),
        episodes=eps,
    )


def whole_and_split(tok) -> tuple[Rollouts, Rollouts]:
    """Two episodes of one prompt; the first whole (prompt | ab | <t=7> | cd eos), or split after its tool answer
    (prompt | ab, then prompt ab <t=7> | cd eos); the second, a plain 'xy' eos, the same in both."""
    p, a, t, c = ids(tok, PROMPT), ids(tok, FIRST), ids(tok, TOOL), ids(tok, SECOND) + [tok.eos_token_id]
    other = (p, ids(tok, "xy") + [tok.eos_token_id], [1] * 3)
    whole = rollouts(tok, [(p, a + t + c, [1] * len(a) + [0] * len(t) + [1] * len(c)), other], [[], []])
    second = TokenSequence(p + a + t, c, [1] * len(c), [-1.0] * len(c), turns=1)
    split = rollouts(tok, [(p, a, [1] * len(a)), other], [[second], []])
    return whole, split


def test_further_sequences_join_with_their_episodes_advantage_and_token_count(tok):
    whole, split = whole_and_split(tok)
    rows = training_rows(split, torch.tensor([0.5, -0.5]))
    assert rows.episodes == 2 and rows.rollouts.num_completions == 3 and rows.dropped == 0
    assert rows.advantages.tolist() == [0.5, -0.5, 0.5]  # the episode's one advantage, on both its sequences
    # episode 0: 2 + 3 sampled tokens (ab, cd eos) on its two rows; episode 1: its own 3
    assert rows.episode_tokens.tolist() == [5.0, 3.0, 5.0]
    ro = rows.rollouts
    assert ro.prompt_ids[2][ro.prompt_mask[2].bool()].tolist() == ids(tok, PROMPT + FIRST + TOOL)
    assert ro.completion_ids[2][ro.completion_mask[2].bool()].tolist() == ids(tok, SECOND) + [tok.eos_token_id]
    assert int(ro.loss_mask.sum()) == int(whole.loss_mask.sum()) == 8  # every sampled token once
    assert training_rows(whole, torch.tensor([0.5, -0.5])).rollouts is whole  # nothing further: the record as is
    per_token = training_rows(split, torch.zeros(2, 9))
    assert per_token.dropped == 1 and per_token.rollouts is split  # distillation's [N, T]: the row only


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_an_episode_split_at_its_own_context_trains_exactly_as_one_sequence(tok, model, loss):
    """Same loss, same gradient (so the same weights after the step) whether the episode is one sequence or two:
    an episode counts once. The naive count (3 sequences, each its own mean) is a different loss under grpo."""
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.update.adaptive.enabled, cfg.algo.loss = 16, False, loss
    whole, split = whole_and_split(tok)
    adv = torch.tensor([1.0, -0.5])
    models = [copy.deepcopy(model) for _ in range(2)]
    stats = [Trainer(m, cfg, total_steps=1).update(r, adv) for m, r in zip(models, (whole, split), strict=True)]
    assert stats[0].tokens == stats[1].tokens == 8
    assert stats[1].loss == pytest.approx(stats[0].loss, abs=1e-6)
    assert stats[1].grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-4)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    if loss == "grpo":  # each row its own episode: (mean over ab, mean over cd eos, mean over xy eos) / 3 differs
        naive = dataclasses.replace(training_rows(split, adv).rollouts, group_size=3)  # three one-row episodes
        stat = Trainer(copy.deepcopy(model), cfg, total_steps=1).update(naive, torch.tensor([1.0, -0.5, 1.0]))
        # pass 1's ratio is 1: whole -(1 - 0.5) / 2 = -0.25; naive -(1 + 1 - 0.5) / 3 = -0.5
        assert stats[0].loss == pytest.approx(-0.25, abs=1e-6) and stat.loss == pytest.approx(-0.5, abs=1e-6)
