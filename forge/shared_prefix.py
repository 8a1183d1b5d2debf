"""Shared-prefix packing for the update: each group's prompt is computed once, not once per completion.

A GRPO micro-batch holds G completions of the same prompt side by side; the plain forward runs the prompt G times
(and its backward G times). Packed, one row per group holds the prompt once followed by its K completion slots:

    [ prompt (P, left-padded) | slot 0 (T) | slot 1 (T) | ... | slot K-1 (T) ]            L = P + K*T

with a 4D attention mask in which a slot's tokens see the prompt and the earlier tokens of their own slot, never
another slot, and position ids that restart after the prompt in every slot. Each completion token then sees exactly
the context it sees in the plain forward, so its log-prob is the same up to float rounding, and the gradient that
reaches the prompt's activations is the sum over the group's completions, accumulated once instead of G times. The
logits are taken only where they predict a completion token: the prompt's last position for a slot's first token,
the slot's own previous position for the rest (transformers' `logits_to_keep` with an index tensor).

Packing trades linear-layer work for attention work: the prompt's tokens are computed once, but the packed row's
attention spans the whole row (masked pairs are computed too). `pack_saves_compute` compares the two FLOP counts
and the trainer packs only when packing is cheaper (a long prompt with short completions: always; a short prompt
with 1k-token completions: not). Consecutive rows with identical prompt ids form a group, so a group split between
micro-batches or ranks is packed per piece, and rows that share no prompt are a group of one (no saving, same
numbers). Only `sdpa` and `eager` attention read a custom 4D mask; other kernels use the plain forward, and so do
models with chunked attention, or a sliding window shorter than a row's prompt + completion (the custom mask
replaces the model's own, so it must give the same keys).
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
class PackedGroups:
    input_ids: torch.Tensor  # [Gp, L] Gp packed rows (groups), L = P + K*T
    position_ids: torch.Tensor  # [Gp, L]
    attention: torch.Tensor  # [Gp, 1, L, L] bool, query (dim 2) may attend key (dim 3)
    keep: torch.Tensor  # [K*T] positions whose logits predict slot j's token t, in (j, t) order
    rows: torch.Tensor  # [n] index g*K + j of each original row's slot
    slots: int  # K


def group_spans(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive rows with the same prompt (ids and mask). [n, P] -> spans.

    >>> group_spans(torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]]), torch.ones(4, 2))
    [(0, 2), (2, 3), (3, 4)]
    """
    n = prompt_ids.shape[0]
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [n-1]
    starts = [0] + [i + 1 for i in torch.nonzero(~same).flatten().tolist()]
    return list(zip(starts, starts[1:] + [n], strict=True))


def pack_saves_compute(cost: PackingCost, spans: list[tuple[int, int]], prompt_len: int, comp_len: int) -> bool:
    """Whether the packed forward costs fewer FLOPs than the plain one (both over their padded widths)."""
    slots = max(stop - start for start, stop in spans)
    n = spans[-1][1]
    plain = cost.forward_flops(n, prompt_len + comp_len)
    packed = cost.forward_flops(len(spans), prompt_len + slots * comp_len)
    return packed < plain


def pack(prompt_ids, prompt_mask, completion_ids, completion_mask, spans: list[tuple[int, int]]) -> PackedGroups:
    """Lay each span's prompt once and its completions in slots after it ([n, P], [n, T] -> PackedGroups)."""
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    K = max(stop - start for start, stop in spans)
    starts = torch.tensor([start for start, _ in spans], device=prompt_ids.device)
    slot_rows = [list(range(start, stop)) + [start] * (K - (stop - start)) for start, stop in spans]  # pad: a copy
    filled = torch.tensor([[j < stop - start for j in range(K)] for start, stop in spans], device=prompt_ids.device)
    idx = torch.tensor(slot_rows, device=prompt_ids.device)  # [Gp, K]
    comp_ids = completion_ids[idx].reshape(len(spans), K * T)
    comp_mask = (completion_mask[idx] * filled[:, :, None]).reshape(len(spans), K * T)  # empty slots: all masked
    p_mask = prompt_mask[starts]  # [Gp, P]
    real = torch.cat([p_mask, comp_mask], dim=1).bool()  # [Gp, L]
    prompt_pos = (p_mask.long().cumsum(1) - 1).clamp(min=0)
    slot_pos = p_mask.long().sum(1, keepdim=True) + torch.arange(T, device=prompt_ids.device).repeat(K)  # [Gp, K*T]
    segment = torch.cat([torch.zeros(P, dtype=torch.long), torch.arange(1, K + 1).repeat_interleave(T)])
    segment = segment.to(prompt_ids.device)  # [L]: 0 = prompt, j+1 = slot j
    L = P + K * T
    causal = torch.ones(L, L, dtype=torch.bool, device=prompt_ids.device).tril()
    visible = causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))  # [L(q), L(k)]
    attention = (visible[None] & real[:, None, :]) | torch.eye(L, dtype=torch.bool, device=prompt_ids.device)
    t = torch.arange(T, device=prompt_ids.device)
    keep = torch.cat([torch.where(t == 0, P - 1, P + j * T + t - 1) for j in range(K)])  # [K*T]
    rows = torch.cat([g * K + torch.arange(stop - start) for g, (start, stop) in enumerate(spans)])
    return PackedGroups(
        input_ids=torch.cat([prompt_ids[starts], comp_ids], dim=1),
        position_ids=torch.cat([prompt_pos, slot_pos], dim=1),
        attention=attention[:, None],
        keep=keep,
        rows=rows.to(prompt_ids.device),
        slots=K,
    )


def packed_logits(model, packed: PackedGroups, mask_kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Logits predicting each original row's completion tokens, [n, T, V], from one packed forward."""
    mask = packed.attention
    if mask_kind == "additive":  # eager attention adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    out = model(
        input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, logits_to_keep=packed.keep
    )
    logits = out.logits  # [Gp, K*T, V]
    Gp, _, V = logits.shape
    return logits.reshape(Gp * packed.slots, -1, V)[packed.rows]  # [n, T, V]
