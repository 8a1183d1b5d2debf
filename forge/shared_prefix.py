"""Shared-prefix, padding-free packing for the update: each group's prompt is computed once, and no padding at all.

A GRPO micro-batch holds G completions of the same prompt side by side; the plain forward runs the prompt G times
(and its backward G times), and every row is padded to the micro-batch's longest prompt and longest completion.
Packed, the whole micro-batch is one row holding each group's prompt once (its real tokens only), followed by each
of the group's completions up to its last real token:

    [ prompt 0 | completion 0.0 | completion 0.1 | ... | prompt 1 | completion 1.0 | ... ]      L = real tokens

with a 4D attention mask in which a token sees only earlier tokens of its own group's prompt and of its own
completion (never another completion or another group), masked completion tokens are no key (as in the plain
mask), and position ids that restart after the prompt in every completion. Each completion token then sees exactly
the context it sees in the plain forward, so its log-prob is the same up to float rounding, and the gradient that
reaches the prompt's activations is the sum over the group's completions, accumulated once instead of G times. The
logits are taken only where they predict a completion token: the prompt's last position for a completion's first
token, the completion's own previous position for the rest (transformers' `logits_to_keep` with an index tensor).

Packing trades linear-layer work for attention work: the prompt's tokens are computed once and padding not at all,
but the packed row's attention spans the whole row (masked pairs are computed too). `pack_saves_compute` compares
the two FLOP counts and the trainer packs only when packing is cheaper (a long prompt with short completions:
always; a short prompt with 1k-token completions: not). Consecutive rows with identical prompt ids form a group,
so a group split between micro-batches or ranks is packed per piece, and rows that share no prompt are a group of
one (their padding is still saved). Only `sdpa` and `eager` attention read a custom 4D mask; other kernels use the
plain forward, and so do models with chunked attention, or a sliding window shorter than a row's prompt +
completion (the custom mask replaces the model's own, so it must give the same keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASKED_KERNELS = {"sdpa": "bool", "eager": "additive"}


@dataclass(frozen=True)
class PackingCost:
    """FLOP model of one forward: `per_token` for the linear layers, `per_pair` for one attended (query, key)."""

    per_token: float  # 2 x parameters outside the embedding and the LM head
    per_pair: float  # 4 x attention width x layers (scores and the weighted sum)
    mask_kind: str  # "bool" (sdpa: True = attend) or "additive" (eager: 0 or the dtype's minimum)
    window: int | None = None  # sliding-window attention: the longest row context the packed mask reproduces

    @classmethod
    def of(cls, model) -> PackingCost | None:
        """The cost model of an (unwrapped) HF causal LM, or None where its attention kernel takes no 4D mask."""
        config = model.config
        kind = MASKED_KERNELS.get(getattr(config, "_attn_implementation", None) or "")
        if kind is None or set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}:
            return None  # chunked or other attention patterns: the custom mask would replace them
        heads = getattr(config, "num_attention_heads", 1)
        width = getattr(config, "head_dim", None) or config.hidden_size // heads
        lookups = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
        params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)  # the LM head: same in both
        per_pair = 4.0 * heads * width * config.num_hidden_layers
        return cls(
            per_token=2.0 * params, per_pair=per_pair, mask_kind=kind, window=getattr(config, "sliding_window", None)
        )

    def fits(self, context: int) -> bool:
        """Whether rows of `context` tokens (prompt + completion) see the same keys packed: the packed mask is full
        attention, which equals a sliding window only while the whole context fits in it."""
        return self.window is None or context <= self.window

    def forward_flops(self, rows: int, length: int) -> float:
        return rows * (length * self.per_token + length * length * self.per_pair)


@dataclass(frozen=True)
class PackedRow:
    input_ids: torch.Tensor  # [1, L] every group's real prompt tokens once, then its completions' tokens
    position_ids: torch.Tensor  # [1, L]
    attention: torch.Tensor  # [1, 1, L, L] bool, query (dim 2) may attend key (dim 3)
    keep: torch.Tensor  # [C] positions whose logits predict the packed completion tokens, rows in order
    targets: torch.Tensor  # [1, C] those completion tokens
    taken: torch.Tensor  # [n, T] bool: the completion positions in the pack (each row's first lengths[i])


def group_spans(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive rows with the same prompt (ids and mask). [n, P] -> spans.

    >>> group_spans(torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]]), torch.ones(4, 2))
    [(0, 2), (2, 3), (3, 4)]
    """
    n = prompt_ids.shape[0]
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [n-1]
    starts = [0] + [i + 1 for i in torch.nonzero(~same).flatten().tolist()]
    return list(zip(starts, starts[1:] + [n], strict=True))


def completion_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """[n] tokens of each completion through its last real one (a masked token before it is context, kept).

    >>> completion_lengths(torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])).tolist()
    [2, 3, 0]
    """
    T = completion_mask.shape[1]
    last = torch.where(completion_mask.bool(), torch.arange(1, T + 1, device=completion_mask.device), 0)
    return last.max(dim=1).values


def packed_length(prompt_mask: torch.Tensor, lengths: torch.Tensor, spans: list[tuple[int, int]]) -> int:
    """Tokens in the packed row: each span's real prompt tokens once plus its completions' lengths."""
    prompts = prompt_mask[[start for start, _ in spans]].sum()
    return int(prompts) + int(lengths.sum())


def pack_saves_compute(cost: PackingCost, rows: int, padded_len: int, packed_len: int) -> bool:
    """Whether one packed row of `packed_len` tokens costs fewer FLOPs than `rows` plain rows of `padded_len`."""
    return cost.forward_flops(1, packed_len) < cost.forward_flops(rows, padded_len)


def pack(prompt_ids, prompt_mask, completion_ids, completion_mask, spans: list[tuple[int, int]]) -> PackedRow | None:
    """The micro-batch as one padding-free row ([n, P], [n, T] -> PackedRow); None (the plain forward) where a
    prompt is empty or no completion has a token."""
    device, T = prompt_ids.device, completion_ids.shape[1]
    lengths = completion_lengths(completion_mask).tolist()
    ids, real, positions, block, segment, keep = [], [], [], [], [], []
    at = 0  # next position in the row
    for g, (start, stop) in enumerate(spans):
        prompt = prompt_ids[start][prompt_mask[start].bool()]
        p = prompt.numel()
        if p == 0:
            return None  # nothing predicts a first completion token
        ids.append(prompt)
        real.append(torch.ones(p, dtype=torch.bool, device=device))
        positions.append(torch.arange(p, device=device))
        block.append(torch.full((p,), g, device=device))
        segment.append(torch.zeros(p, dtype=torch.long, device=device))
        last_prompt = at + p - 1
        at += p
        for i in range(start, stop):
            n_i = lengths[i]
            if n_i == 0:
                continue
            m = completion_mask[i, :n_i]
            ids.append(completion_ids[i, :n_i])
            real.append(m.bool())
            positions.append((p + m.long().cumsum(0) - 1).clamp(min=0))  # as the plain row's cumsum over its mask
            block.append(torch.full((n_i,), g, device=device))
            segment.append(torch.full((n_i,), i + 1, device=device))
            keep.append(
                torch.cat([torch.tensor([last_prompt], device=device), at + torch.arange(n_i - 1, device=device)])
            )
            at += n_i
    if not keep:
        return None
    block_, segment_, real_ = torch.cat(block), torch.cat(segment), torch.cat(real)
    L = block_.numel()
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    same_context = (block_[:, None] == block_[None, :]) & (
        (segment_[None, :] == 0) | (segment_[None, :] == segment_[:, None])
    )
    attention = causal & same_context & real_[None, :]  # [L(q), L(k)]; every query sees its prompt's first token
    taken = torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]  # [n, T]
    input_ids = torch.cat(ids)[None]
    return PackedRow(
        input_ids=input_ids,
        position_ids=torch.cat(positions)[None],
        attention=attention[None, None],
        keep=torch.cat(keep),
        targets=completion_ids[taken][None],
        taken=taken,
    )


def packed_logits(model, packed: PackedRow, mask_kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Logits predicting the packed completion tokens, [1, C, V], from one packed forward."""
    mask = packed.attention
    if mask_kind == "additive":  # eager attention adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    out = model(
        input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, logits_to_keep=packed.keep
    )
    return out.logits  # [1, C, V]
