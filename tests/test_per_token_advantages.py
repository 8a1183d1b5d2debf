"""Per-token advantages ([N, T], on-policy distillation) through the update path: the per-completion [N] case is
their broadcast, so the same values given as an explicitly expanded [N, T] tensor must train bitwise the same
(every loss variant, packed and plain, with a multi-turn loss mask, TIS, several PPO passes and the KL term), and a
per-token tensor must reach each token as given (micro-batch slicing cuts it to the micro-batch's width).

The rollouts are tests/test_shared_prefix.py's: groups of 3, 1 and 2 completions of different prompts, right-padded
to T = 5, so a micro-batch of 4 rows splits two groups and its width is cut below T.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from forge.advantages import advantage_mass, advantage_rows, per_completion
from forge.config import RunConfig
from forge.recipes.grpo import LOSSES
from tests.grpo_parts import Trainer
from tests.test_shared_prefix import T, packed_calls, rollouts, tiny  # noqa: F401  (packed_calls: a fixture)

torch.set_num_threads(1)

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 0.75, -1.0, 0.5])  # [N]


def multi_turn(tok):
    """The rollouts with a loss mask that leaves out one attended token in rows 0 and 4 (as an environment's token
    is), and sampler log-probs away from the trainer's (so TIS weights are not all 1)."""
    ro = rollouts(tok)
    loss_mask = ro.completion_mask.clone()
    loss_mask[0, 1] = loss_mask[4, 0] = 0
    sampler = -torch.linspace(0.5, 3.0, ro.completion_mask.numel()).view_as(ro.completion_mask.float())
    return dataclasses.replace(ro, loss_mask=loss_mask, sampling_logprobs=sampler * ro.completion_mask)


def config(loss: str, shared: bool, beta: float = 0.0, iters: int = 1, tis: bool = False) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.rollout.temperature = T, 0.7
    cfg.update.micro_batch_size, cfg.update.lr, cfg.update.shared_prefix = 4, 1e-2, shared
    cfg.update.num_iterations, cfg.update.adaptive.enabled = iters, False
    cfg.algo.loss, cfg.algo.beta, cfg.algo.is_correction = loss, beta, "tis" if tis else "none"
    return cfg


def train_twice(tok, cfg: RunConfig, ro, advantages):
    """Two updates from the same tiny model: (stats without the clock, parameters, gradients of the last pass)."""
    base = tiny(tok).train()
    ref = copy.deepcopy(base).eval().requires_grad_(False) if cfg.algo.beta > 0 else None
    trainer = Trainer(copy.deepcopy(base), cfg, total_steps=2, ref_model=ref)
    stats = [dataclasses.replace(trainer.update(ro, advantages), seconds=0.0) for _ in range(2)]
    params = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    grads = {n: p.grad.clone() for n, p in trainer.unwrapped.named_parameters() if p.grad is not None}
    return stats, params, grads


VARIANTS = [(loss, {}) for loss in LOSSES] + [
    ("dapo", {"beta": 0.1, "iters": 2}),
    ("grpo", {"tis": True}),
    ("cispo", {"tis": True, "iters": 2}),
]


@pytest.mark.parametrize("shared", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("loss, extra", VARIANTS, ids=[f"{v[0]}-{'-'.join(v[1]) or 'base'}" for v in VARIANTS])
def test_broadcast_per_token_advantages_train_bitwise_like_per_completion(tok, packed_calls, loss, extra, shared):  # noqa: F811
    ro = multi_turn(tok)
    cfg = config(loss, shared, **extra)
    per_seq = train_twice(tok, cfg, ro, ADVANTAGES)
    per_token = train_twice(tok, cfg, ro, ADVANTAGES.unsqueeze(1).expand(-1, T).contiguous())  # [N, T]
    assert (len(packed_calls) > 0) is shared  # the shared-prefix path did run (and only when asked)
    assert per_seq[0] == per_token[0]  # every UpdateStats field, bitwise (float ==)
    assert per_seq[0][0].grad_norm > 0 and per_seq[0][1].entropy != per_seq[0][0].entropy  # it trained
    for name, w in per_seq[1].items():
        assert torch.equal(w, per_token[1][name]), name
    assert per_seq[2].keys() == per_token[2].keys() and per_seq[2]
    for name, g in per_seq[2].items():
        assert torch.equal(g, per_token[2][name]), name


def test_a_per_token_advantage_reaches_only_its_token(tok):
    """An advantage on one sampled token of row 2 (token_mean: the loss is -A_t * logp_t / tokens at ratio 1) gives
    the gradient of that token's log-prob alone; the same value on a token outside the loss mask gives none."""
    ro = multi_turn(tok)
    cfg = config("dapo", shared=False)
    cfg.update.micro_batch_size = 6
    adv = torch.zeros(6, T)
    adv[2, 1] = 1.0
    _, _, grads = train_twice(tok, cfg, ro, adv)
    adv_masked = torch.zeros(6, T)
    adv_masked[0, 1] = 5.0  # loss_mask[0, 1] = 0: an environment token
    _, _, none = train_twice(tok, cfg, ro, adv_masked)
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0
    assert all(float(g.abs().sum()) == 0.0 for g in none.values())


def test_per_token_helpers_slice_and_summarise():
    adv = torch.arange(12.0).view(3, 4) - 6  # [N=3, T=4]
    assert torch.equal(advantage_rows(adv, slice(0, 2), 3), adv[:2, :3])
    assert torch.equal(advantage_rows(ADVANTAGES, slice(1, 3), 3), ADVANTAGES[1:3])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # |adv| on the masked tokens: 6, 5 (row 0), 2 (row 1) -> 13 / 3
    assert advantage_mass(adv, mask) == pytest.approx(13 / 3)
    assert advantage_mass(ADVANTAGES, mask) == float(ADVANTAGES.abs().mean())  # [N]: as before, mask unused
    assert per_completion(adv, mask).tolist() == [-5.5, -2.0, 0.0]  # a row with no loss token: 0
