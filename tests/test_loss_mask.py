"""The loss mask of multi-turn episodes (issue 30, acceptance 1): tool tokens are attended to, never trained.

One episode per row: a prompt, a sampled segment, a tool segment, a sampled segment. `completion_mask` is 1 on all
of it (attention), `loss_mask` 1 only on the sampled segments. The gradient of the loss with respect to the
per-token log-probs is exactly 0 at the tool positions (their loss contributes nothing) and not 0 at the sampled
ones, for every loss variant, with the KL term and the TIS weights; changing a tool token changes the log-probs of
the sampled tokens after it and of none before it (plain and shared-prefix packed forward alike).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from forge.config import AlgoConfig, RunConfig
from forge.losses import StepTotals
from forge.models import build_char_tokenizer, build_tiny_model
from forge.recipes.grpo import update_micro_batch
from forge.records import MicroBatch, Rollouts
from forge.shared_prefix import PackingCost
from forge.trainer import token_logprobs
from tests.grpo_parts import Trainer

torch.set_num_threads(1)

SAMPLED_1, TOOL, SAMPLED_2 = "ab", "<t=7>", "cd"  # 2 sampled, 5 tool, 2 sampled tokens (+ eos)
TOOL_SPAN = slice(2, 7)  # the tool tokens' positions in the completion region


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden=32, layers=2, seed=0, attn_implementation="sdpa")


def episode(tok, tool: str = TOOL, rows: int = 2) -> Rollouts:
    """`rows` copies (one group) of prompt | sampled | tool | sampled + eos."""
    ids = [tok(s, add_special_tokens=False)["input_ids"] for s in (SAMPLED_1, tool, SAMPLED_2)]
    completion = ids[0] + ids[1] + ids[2] + [tok.eos_token_id]
    loss = [1] * len(ids[0]) + [0] * len(ids[1]) + [1] * (len(ids[2]) + 1)
    prompt = tok(["3+4="] * rows, return_tensors="pt", add_special_tokens=False)
    T = len(completion)
    return Rollouts(
        prompt_ids=prompt["input_ids"],
        prompt_mask=prompt["attention_mask"],
        completion_ids=torch.tensor([completion] * rows),  # [N, T]
        completion_mask=torch.ones(rows, T, dtype=torch.long),  # every token attended
        sampling_logprobs=torch.full((rows, T), -1.0) * torch.tensor([loss] * rows),  # 0 off the sampled tokens
        texts=[SAMPLED_1 + tool + SAMPLED_2] * rows,
        finish_reasons=["stop"] * rows,
        group_size=rows,
        policy_version=0,
        loss_mask=torch.tensor([loss] * rows),  # [N, T]
    )


def micro_batch(ro: Rollouts, advantages, ref_logp=None) -> MicroBatch:
    return MicroBatch(ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, advantages,
                      ro.sampling_logprobs, ref_logp=ref_logp, loss_mask=ro.loss_mask)  # fmt: skip


def logp_grad(model, ro: Rollouts, algo: AlgoConfig) -> torch.Tensor:
    """d loss / d logp [N, T] through the recipe's micro-batch update."""
    held = {}

    def policy(mb):
        out = token_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask)
        out.logp.retain_grad()
        held["logp"] = out.logp
        return out

    ref = torch.full(ro.completion_ids.shape, -3.0) if algo.beta > 0 else None
    totals = StepTotals(sequences=ro.num_completions, tokens=int(ro.loss_mask.sum()), max_len=16)
    mb = micro_batch(ro, torch.tensor([1.0, -1.0]), ref)
    update_micro_batch(policy, mb, algo, totals, backward=lambda loss: loss.backward())
    return held["logp"].grad


@pytest.mark.parametrize(
    "loss,beta,tis",
    [
        ("grpo", 0.0, False),
        ("dr_grpo", 0.0, False),
        ("dapo", 0.0, True),
        ("gspo", 0.1, False),
        ("cispo", 0.0, True),
    ],  # fmt: skip
)
def test_tool_tokens_get_no_gradient_but_sampled_ones_do(tok, model, loss, beta, tis):
    algo = AlgoConfig(loss=loss, beta=beta, is_correction="tis" if tis else "none")
    grad = logp_grad(copy.deepcopy(model), episode(tok), algo)  # [N, T]
    assert torch.all(grad[:, TOOL_SPAN] == 0)
    sampled = torch.ones(grad.shape[1], dtype=torch.bool)
    sampled[TOOL_SPAN] = False
    assert torch.all(grad[:, sampled] != 0)


@pytest.mark.parametrize("packed", [False, True])
def test_a_tool_token_is_attended_by_the_sampled_tokens_after_it(tok, model, packed):
    packing = PackingCost.of(model) if packed else None
    ro, other = episode(tok, "<t=7>"), episode(tok, "<t=9>")

    def logp(r):
        return token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                              packing=packing).logp  # fmt: skip

    with torch.no_grad():
        a, b = logp(ro), logp(other)
    changed = 5  # the '7' -> '9' at completion position 5 (2 sampled + '<t=')
    assert torch.equal(a[:, :changed], b[:, :changed])  # nothing before it sees it
    after = slice(TOOL_SPAN.stop, None)  # the second sampled segment and its eos
    assert not torch.allclose(a[:, after], b[:, after])


def test_trainer_counts_and_trains_only_sampled_tokens(tok, model):
    """An update over the episode trains on the loss mask's 5 tokens per row; the sampler's log-probs at the tool
    positions (0 there) never enter the log-prob diff: garbage there changes nothing."""
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.update.adaptive.enabled = 16, False
    ro = episode(tok)
    noisy = dataclasses.replace(ro, sampling_logprobs=ro.sampling_logprobs.masked_fill(ro.loss_mask == 0, -50.0))
    adv = torch.tensor([1.0, -1.0])
    stats = [Trainer(copy.deepcopy(model), cfg, total_steps=1).update(r, adv) for r in (ro, noisy)]
    assert stats[0].tokens == 2 * 5
    assert stats[0].logprob_diff == stats[1].logprob_diff and stats[0].loss == stats[1].loss


def test_single_turn_loss_mask_is_the_completion_mask(tok):
    ro = dataclasses.replace(episode(tok), loss_mask=None)
    assert ro.loss_mask is ro.completion_mask


def test_replicas_records_concatenate_their_loss_masks(tok):
    from forge.rollout.base import concat_rollouts

    a, b = episode(tok), episode(tok, "<t=77>")  # b's tool segment is one token longer
    both = concat_rollouts([a, b], tok.pad_token_id)
    assert both.loss_mask.shape == both.completion_mask.shape == (4, b.completion_ids.shape[1])
    assert both.loss_mask[:2, : a.loss_mask.shape[1]].tolist() == a.loss_mask.tolist()
    assert both.loss_mask[:2, a.loss_mask.shape[1] :].sum() == 0 and both.episodes is None
    single = concat_rollouts([dataclasses.replace(a, loss_mask=None)] * 2, tok.pad_token_id)
    assert single.loss_mask is single.completion_mask  # still single-turn for the trainer (`_loss_mask`)
