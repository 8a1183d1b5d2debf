"""Episodes of several training sequences, as rows of the update.

An agent episode whose agent rewrote its history (summarised, dropped or reordered messages: `forge.env.agent`) is
several token sequences, each a prompt and its own sampled tokens. `Rollouts` keeps one row per episode, its first
sequence, so everything that reads a step per episode is unchanged: the verifiers score the episode once, the reward
is the episode's, and the group advantages are computed over the G episodes of each prompt (row i -> prompt i // G).
The other sequences travel in `Episodes.more_sequences`; `training_rows` appends them after the episodes' rows for the
update, each with its episode's advantage (broadcast, never recomputed).

The normalisers count an episode once (`forge.losses.StepTotals`): `sequences` is the number of episodes, `tokens` the
loss tokens of every sequence (a sampled token is in exactly one sequence's loss mask: tokens a later prompt repeats
are prompt, not loss), and the per-sequence mean (algo.loss grpo, gspo) divides each sequence's loss sum by its
episode's loss tokens (`row_tokens`), so an episode split in k sequences adds what one sequence holding the same
sampled tokens would add: the sum over its sequences of (n_s / n_e) x that sequence's token mean. The token mean
(dapo, cispo) and the horizon mean (dr_grpo) need nothing more. GSPO's ratio is one per sequence, not per episode.

Per-token advantages (on-policy distillation, `distill.teacher`) exist only for the episodes' rows (the teacher scores
`Rollouts`): with them, the further sequences are not trained (`dropped`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from forge.records import Rollouts
from forge.rollout.base import cat_padded


@dataclass(frozen=True)
class TrainingRows:
    """What the update trains: the episodes' rows, then their further sequences."""

    rollouts: Rollouts  # [N + X] rows (X further sequences)
    advantages: torch.Tensor  # [N + X], or [N, T] per token as given (then X = 0)
    episodes: int  # N: the count the normalisers divide by
    episode_tokens: torch.Tensor | None  # [N + X] loss tokens of each row's episode; None when X = 0
    dropped: int = 0  # further sequences left out (per-token advantages)


def training_rows(ro: Rollouts, advantages: torch.Tensor) -> TrainingRows:
    """The step's rows for the update: `ro`'s, then every episode's further sequences with its advantage."""
    more = [(i, s) for i, seqs in enumerate(ro.episodes.more_sequences if ro.episodes else []) for s in seqs]
    n = ro.num_completions
    if not more:
        return TrainingRows(ro, advantages, n, None)
    if advantages.dim() != 1:
        return TrainingRows(ro, advantages, n, None, dropped=len(more))
    owner = torch.tensor([i for i, _ in more], dtype=torch.long)
    tokens = ro.loss_mask.sum(1).double()  # [N]: each episode's loss tokens, its row's, then its sequences'
    tokens.index_add_(0, owner, torch.tensor([float(sum(s.loss)) for _, s in more], dtype=torch.float64))
    seqs = [s for _, s in more]
    row = lambda xs, dtype: torch.tensor([list(xs) or [0]], dtype=dtype)  # noqa: E731  [1, len] (at least 1 wide)
    ids = lambda f, dtype: [row(f(s), dtype) for s in seqs]  # noqa: E731
    grown = dataclasses.replace(
        ro,
        prompt_ids=cat_padded([ro.prompt_ids, *ids(lambda s: s.prompt_ids, torch.long)], 0, left=True),
        prompt_mask=cat_padded([ro.prompt_mask, *ids(lambda s: [1] * len(s.prompt_ids), torch.long)], 0, left=True),
        completion_ids=cat_padded([ro.completion_ids, *ids(lambda s: s.ids, torch.long)], 0, left=False),
        completion_mask=cat_padded([ro.completion_mask, *ids(lambda s: [1] * len(s.ids), torch.long)], 0, left=False),
        sampling_logprobs=cat_padded([ro.sampling_logprobs, *ids(lambda s: s.logprobs, torch.float32)], 0.0, left=False),
        loss_mask=cat_padded([ro.loss_mask, *ids(lambda s: s.loss, torch.long)], 0, left=False),
        texts=ro.texts + [""] * len(seqs),
        finish_reasons=ro.finish_reasons + ["stop"] * len(seqs),
        prompts=ro.prompts + [""] * len(seqs) if ro.prompts else ro.prompts,
        episodes=None,
    )  # fmt: skip
    per_row = torch.cat([tokens, tokens[owner]]).float()
    return TrainingRows(grown, torch.cat([advantages, advantages[owner]]), n, per_row)
