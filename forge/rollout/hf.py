"""In-process rollout with Hugging Face `generate`.

Prompts are left-padded, completions right-padded. The completion mask covers sampled tokens up to and
including the first eos (so pad == eos tokenizers keep their eos), never `token != pad`. Sampling
log-probs are those of the distribution actually sampled from (after temperature and top-p): the temperature and
top-p warpers are passed to `generate` as logits processors followed by `_PickToken`, which samples the token
itself (inverse CDF: torch.multinomial's per-entry exponential draws were 14% of a rollout) and keeps only the
chosen tokens' log-probs step by step, never the [n, T, vocab] scores (tens of GB at 1k tokens, 150k vocabulary).
`generate` is called on chunks of `batch_size` sequences (`rollout.batch_size`; `SamplingParams.batch_size` for
evaluation).

Shared prefill (`rollout.shared_prefill`, on by default, n > 1): a chunk holds whole groups, max(1, batch_size // n)
distinct prompts; one forward pass over those prompts minus their last token fills a `DynamicCache` (positions from
the left-padded mask, as `generate` derives them), which is repeated n times per prompt and handed to `generate`
with the expanded ids and mask, so `generate` runs only the last prompt token and the new tokens. The tokens equal
the plain path's up to float noise (a seeded rollout draws the same tokens when the chunks are the same size, i.e.
batch_size is a multiple of n or every sequence fits in one chunk). Where `generate` cannot take an outside cache
(prompt-learning adapters, a `cache_implementation`, `use_cache=False`, cache-less models) or the prefill yields
no `DynamicCache` of attention layers, or every prompt of a chunk is one token, that chunk runs the plain way.

Colocated with the trainer, weight sync is free: the backend holds the trainer's module.
"""

from __future__ import annotations

import contextlib
import math

import torch
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from forge.precision import bf16_autocast
from forge.records import Rollouts
from forge.rollout.base import SamplingParams, cat_padded


class HFBackend:
    def __init__(
        self, model, tokenizer, autocast_bf16: bool = False, batch_size: int = 64, shared_prefill: bool = True
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.autocast_bf16 = bf16_autocast(autocast_bf16, model.device.type, "rollout.autocast_bf16")
        self.batch_size = batch_size
        self.shared_prefill = shared_prefill
        self.policy_version = 0

    def sync_weights(self, model, version: int) -> float:
        self.model = model
        self.policy_version = version
        return 0.0  # the trainer's own module: nothing to copy

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        expanded = [p for p in prompts for _ in range(params.n)]  # [N]
        size = params.batch_size or self.batch_size
        share = self.shared_prefill and params.n > 1 and _takes_outside_cache(self.model)
        repeats = params.n if share else 1  # rows per tokenized prompt
        rows = prompts if share else expanded
        per_chunk = max(1, size // params.n) if share else size  # whole groups per chunk
        seeded = params.seed is not None and params.temperature > 0
        with torch.random.fork_rng() if seeded else contextlib.nullcontext():
            if seeded:  # the caller's seed, not this process's RNG: the same completions wherever this runs
                torch.manual_seed(params.seed)
            chunks = [
                self._generate_chunk(rows[i : i + per_chunk], repeats, params) for i in range(0, len(rows), per_chunk)
            ]
        return self._merge(chunks, expanded, params.n)

    def _generate_chunk(self, prompts: list[str], repeats: int, params: SamplingParams) -> dict:
        """`repeats` completions of each prompt ([len(prompts) * repeats] rows); repeats > 1 prefills each prompt once."""
        tok, model = self.tokenizer, self.model
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        greedy = params.temperature == 0
        pick = _PickToken(sample=not greedy)
        warpers = [] if greedy else _warpers(params)
        was_training = model.training
        model.eval()
        autocast = (
            torch.autocast(model.device.type, dtype=torch.bfloat16) if self.autocast_bf16 else contextlib.nullcontext()
        )
        with autocast:
            enc, shared = _expand(model, enc, repeats)  # [n, L]
            sequences = model.generate(
                **enc,
                **shared,
                max_new_tokens=params.max_new_tokens,
                do_sample=False,  # `pick` chooses the token (after our warpers); generate takes it
                temperature=None,
                top_p=None,
                top_k=None,
                logits_processor=LogitsProcessorList([*warpers, pick]),
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        model.train(was_training)
        completion = sequences[:, enc["input_ids"].shape[1] :]  # [n, T]
        logprobs = pick.finish(completion)  # [n, T]
        mask = completion_mask(completion, tok.eos_token_id)
        return {
            "prompt_ids": enc["input_ids"],
            "prompt_mask": enc["attention_mask"],
            "completion_ids": completion,
            "mask": mask,
            "logprobs": logprobs * mask,
        }

    def _merge(self, chunks: list[dict], prompts: list[str], group_size: int) -> Rollouts:
        tok = self.tokenizer
        pad = tok.pad_token_id
        prompt_ids = cat_padded([c["prompt_ids"] for c in chunks], pad, left=True)
        prompt_mask = cat_padded([c["prompt_mask"] for c in chunks], 0, left=True)
        completion_ids = cat_padded([c["completion_ids"] for c in chunks], pad, left=False)
        mask = cat_padded([c["mask"] for c in chunks], 0, left=False)
        logprobs = cat_padded([c["logprobs"] for c in chunks], 0.0, left=False)
        completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, pad))
        texts = [
            tok.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(completion_ids, mask, strict=True)
        ]
        finish = [
            "stop" if _ends_with_eos(ids, m, tok.eos_token_id) else "length"
            for ids, m in zip(completion_ids, mask, strict=True)
        ]
        return Rollouts(
            prompt_ids=prompt_ids.cpu(),
            prompt_mask=prompt_mask.cpu(),
            completion_ids=completion_ids.cpu(),
            completion_mask=mask.cpu(),
            sampling_logprobs=logprobs.cpu(),
            texts=texts,
            finish_reasons=finish,
            group_size=group_size,
            policy_version=self.policy_version,
            prompts=prompts,
        )


def _takes_outside_cache(model) -> bool:
    """Whether `generate` can start from a `DynamicCache` filled here: not for prompt-learning adapters (their virtual
    tokens live in the cache), a `cache_implementation` (generate refuses a cache beside one), `use_cache=False`,
    encoder-decoders, or models `generate` gives no `DynamicCache`."""
    peft_config = getattr(model, "active_peft_config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    gen = model.generation_config
    return (
        not getattr(peft_config, "is_prompt_learning", False)
        and gen.cache_implementation is None
        and gen.use_cache is not False
        and not model.config.is_encoder_decoder
        and base._supports_default_dynamic_cache()
    )


def _expand(model, enc, repeats: int) -> tuple[dict, dict]:
    """(`enc` with each prompt's row repeated `repeats` times, generate's extra kwargs: {"cache": the shared
    prefill's cache, repeated likewise} or {} where generate prefills itself)."""
    if repeats == 1:
        return dict(enc), {}
    cache = _prefill(model, enc)
    if cache is not None:
        cache.batch_repeat_interleave(repeats)  # [n, heads, L - 1, head_dim] per layer
    expanded = {k: v.repeat_interleave(repeats, dim=0) for k, v in enc.items()}
    return expanded, ({"cache": cache} if cache is not None else {})


def _prefill(model, enc) -> DynamicCache | None:
    """The KV cache of every prompt token but the last ([b, L - 1] of the left-padded [b, L]), computed as generate's
    own prefill computes it: positions from the mask (cumsum - 1, pads at 0), no mask when nothing is padded. None
    (generate prefills itself) for 1-token prompts or a cache that is not a `DynamicCache` of attention layers."""
    ids, mask = enc["input_ids"], enc["attention_mask"]  # [b, L]
    if ids.shape[1] < 2:
        return None
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = model(
        input_ids=ids[:, :-1],
        attention_mask=None if bool(mask.all()) else mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        **({"logits_to_keep": 1} if base._supports_logits_to_keep() else {}),  # the logits are not needed
    )
    cache = getattr(out, "cache", None)
    return cache if isinstance(cache, DynamicCache) and not any(cache.is_linear) else None


def _warpers(params: SamplingParams) -> list:
    """generate's own temperature and top-p warpers, in generate's order, for the processor list."""
    out = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    return out + ([TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else [])


class _PickToken(LogitsProcessor):
    """The last logits processor: picks every row's next token itself and records its log-prob under the
    processed distribution. Holds [n, vocab] for one step, never [n, T, vocab].

    Greedy: the argmax. Sampling: `sample_categorical` (exact inverse-CDF sampling, one uniform draw per row). It
    replaces `torch.multinomial`, which took 45 ms of each decoding step on SmolLM2-135M here (14% of a rollout;
    `replacement=True` is no faster). The returned scores are 0 at the chosen token and -inf elsewhere, and
    `generate` runs greedy, so it takes exactly that token."""

    def __init__(self, sample: bool):
        self.sample = sample
        self.logprobs: list[torch.Tensor] = []  # T x [n]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logsm = torch.log_softmax(scores.float(), dim=-1)  # [n, vocab]
        if self.sample:
            chosen = sample_categorical(logsm.exp())  # [n, 1]
        else:
            chosen = scores.argmax(dim=-1, keepdim=True)
        self.logprobs.append(logsm.gather(-1, chosen).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, chosen, 0.0)

    def finish(self, completion: torch.Tensor) -> torch.Tensor:
        """[n, T] log-probs of `completion` (the tokens generate returned: the picked ones, pad after an eos)."""
        assert len(self.logprobs) == completion.shape[1], "one recorded step per generated token"
        if not self.logprobs:
            return torch.zeros(completion.shape, dtype=torch.float32, device=completion.device)
        return torch.stack(self.logprobs, dim=1)


def sample_categorical(probs: torch.Tensor, block: int = 256) -> torch.Tensor:
    """One index per row of `probs` ([n, V], unnormalised, >= 0), drawn with probability p_i / sum(p): exact
    inverse-CDF sampling from one `torch.rand` draw per row, in two levels (the block, then the entry in it) so only
    [n, V / block] sums and one block per row are accumulated, in float64. A zero-probability entry is never drawn.

    >>> _ = torch.manual_seed(0)
    >>> p = torch.tensor([[0.0, 0.25, 0.0, 0.75], [1.0, 0.0, 0.0, 0.0]])
    >>> draws = torch.cat([sample_categorical(p, block=2) for _ in range(4000)], dim=1)  # [2, 4000]
    >>> sorted(set(draws[0].tolist())), round(float((draws[0] == 3).double().mean()), 2), set(draws[1].tolist())
    ([1, 3], 0.75, {0})
    """
    n, V = probs.shape
    pad = -V % block
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(n, -1, block)  # [n, B, block]
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [n, B]
    u = torch.rand(n, 1, dtype=torch.float64, device=probs.device) * block_cdf[:, -1:]  # [n, 1] in [0, total)
    # entry i owns [cdf[i-1], cdf[i]): the first cdf above u; empty blocks and entries own nothing
    b = torch.searchsorted(block_cdf, u, right=True).clamp(max=block_cdf.shape[1] - 1)  # [n, 1]
    before = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n, device=probs.device), b[:, 0]].cumsum(dim=-1, dtype=torch.float64)  # [n, block]
    rest = torch.minimum(u - before, inner[:, -1:] * (1 - 1e-12))  # rounding must not push u past the block's mass
    return b * block + torch.searchsorted(inner, rest, right=True).clamp(max=block - 1)


def completion_mask(completion: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[n, T] long mask: 1 up to and including the first eos, 0 after it.

    >>> completion_mask(torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8]]), eos_id=2).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 1]]
    """
    is_eos = completion == eos_id
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first eos
    return (~after_eos).long()


def _ends_with_eos(ids: torch.Tensor, mask: torch.Tensor, eos_id: int) -> bool:
    n = int(mask.sum())
    return n > 0 and int(ids[n - 1]) == eos_id
