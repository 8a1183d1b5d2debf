"""In-process rollout with Hugging Face `generate`.

Prompts are left-padded, completions right-padded. The completion mask covers sampled tokens up to and
including the first eos (so pad == eos tokenizers keep their eos), never `token != pad`. Sampling
log-probs are those of the distribution actually sampled from (after temperature and top-p): the temperature and
top-p warpers are passed to `generate` as logits processors followed by `_PickToken`, which picks the token
itself (an exact draw, `sample_tokens`) and keeps only the chosen tokens' log-probs step by step, never the
[n, T, vocab] scores (tens of GB at 1k tokens, 150k vocabulary).
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

Multi-turn episodes (`forge.env.episode`) sample each turn with `generate_ids`: the episode's tokens so far, never
re-tokenised, left-padded, decoded the same way (no shared prefill: every context is its own). Each episode's turn
draws from a generator of its own (`seeded_tokens`, seeded per episode and turn by the episode loop), as each vLLM
request does, so a step split between rollout replicas samples what one call would.

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

SAMPLE_BLOCK = 256  # tokens per block of `sample_tokens`'s first stage


class HFBackend:
    def __init__(
        self,
        model,
        tokenizer,
        autocast_bf16: bool = False,
        batch_size: int = 64,
        shared_prefill: bool = True,
        compact_every: int = 4,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.autocast_bf16 = bf16_autocast(autocast_bf16, model.device.type, "rollout.autocast_bf16")
        self.batch_size = batch_size
        self.shared_prefill = shared_prefill
        self.compact_every = compact_every
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

    @torch.no_grad()
    def generate_ids(self, contexts: list[list[int]], params: SamplingParams,
                     seeds: list[int] | None = None) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """One turn of multi-turn episodes (`forge.env`): for each token context (the episode so far, never
        re-tokenised), the sampled tokens up to and including eos (at most params.max_new_tokens) and their log-probs.
        Greedy when temperature is 0. `seeds` (one per context): context i draws from a generator of its own seeded
        `seeds[i]` (`seeded_tokens`), so its tokens do not depend on which contexts share its batch; None: from
        torch's RNG, seeded by the caller."""
        tok, model, out = self.tokenizer, self.model, []
        size = params.batch_size or self.batch_size
        sample = params.temperature > 0
        warpers = _warpers(params) if sample else []
        was_training = model.training
        model.eval()
        for i in range(0, len(contexts), size):
            enc = tok.pad({"input_ids": contexts[i : i + size]}, padding=True, return_tensors="pt").to(model.device)
            gens = [torch.Generator().manual_seed(s) for s in seeds[i : i + size]] if sample and seeds else None
            with autocast_context(model.device.type, self.autocast_bf16):
                tokens, logprobs = self._decode(dict(enc), {}, params, warpers, gens)  # [n, T]
            mask = completion_mask(tokens, tok.eos_token_id).bool()
            out += [(t[m].tolist(), lp[m].tolist()) for t, lp, m in zip(tokens, logprobs, mask, strict=True)]
        model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[str], repeats: int, params: SamplingParams) -> dict:
        """`repeats` completions of each prompt ([len(prompts) * repeats] rows); repeats > 1 prefills each prompt once."""
        tok, model = self.tokenizer, self.model
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        warpers = [] if params.temperature == 0 else _warpers(params)
        was_training = model.training
        model.eval()
        autocast = (
            torch.autocast(model.device.type, dtype=torch.bfloat16) if self.autocast_bf16 else contextlib.nullcontext()
        )
        with autocast:
            enc, shared = _expand(model, enc, repeats)  # [n, L]
            completion, logprobs = self._decode(enc, shared, params, warpers)  # [n, T]
        model.train(was_training)
        mask = completion_mask(completion, tok.eos_token_id)
        return {
            "prompt_ids": enc["input_ids"],
            "prompt_mask": enc["attention_mask"],
            "completion_ids": completion,
            "mask": mask,
            "logprobs": logprobs * mask,
        }

    def _decode(
        self, enc: dict, shared: dict, params: SamplingParams, warpers: list, generators: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, T] completion tokens (pad after eos) and their log-probs, by `generate`. With `compact_every`, generate
        runs that many tokens at a time; between the calls the sequences that have ended leave the batch, and the
        rest go on from their KV cache (`DynamicCache.batch_select_indices`), so decoding computes only live ones.
        `generators`: one per row, each row's own draws (`seeded_tokens`); None: torch's RNG (`sample_tokens`)."""
        tok, model, T = self.tokenizer, self.model, params.max_new_tokens
        ids, mask = enc["input_ids"], enc["attention_mask"]
        every = self.compact_every if self.compact_every and _takes_outside_cache(model) else T
        tokens = torch.full((ids.shape[0], T), tok.pad_token_id, dtype=torch.long, device=ids.device)
        logprobs = torch.zeros(ids.shape[0], T, device=ids.device)
        alive = torch.arange(ids.shape[0], device=ids.device)  # rows of `tokens` still decoding
        done = 0
        while True:
            mine = None if generators is None else [generators[i] for i in alive.tolist()]
            pick = _PickToken(sample=params.temperature > 0, generators=mine)
            steps = min(every, T - done)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **shared,
                max_new_tokens=steps,
                do_sample=False,  # `pick` chooses the token (after our warpers); generate takes it
                temperature=None,
                top_p=None,
                top_k=None,
                logits_processor=LogitsProcessorList([*warpers, pick]),
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                return_dict_in_generate=True,
            )
            new = out.sequences[:, ids.shape[1] :]  # [a, <= steps]: shorter when every sequence ended
            tokens[alive, done : done + new.shape[1]] = new
            logprobs[alive, done : done + new.shape[1]] = pick.finish(new)
            done += new.shape[1]
            live = torch.nonzero(~(new == tok.eos_token_id).any(dim=1)).flatten()
            if done >= T or new.shape[1] < steps or live.numel() == 0 or not isinstance(out.cache, DynamicCache):
                return tokens[:, :done], logprobs[:, :done]
            out.cache.batch_select_indices(live)  # the ended sequences leave the cache and the batch
            ids, mask = out.sequences[live], torch.cat([mask[live], torch.ones_like(new[live])], dim=1)
            alive, shared = alive[live], {"cache": out.cache}

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


def autocast_context(device_type: str, bf16: bool):
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


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

    Greedy: the argmax; sampling: `sample_tokens`, an exact draw from the softmax (or `seeded_tokens` with a generator
    per row, for multi-turn episodes). The returned scores are 0 at the
    chosen token and -inf elsewhere, and `generate` runs greedy, so it takes exactly that token. Picking here rather
    than in `generate` lets the log-prob be recorded at once and lets a batch be compacted between generate calls.
    `generate` hands its processors a copy of the logits, which is overwritten in place."""

    def __init__(self, sample: bool, generators: list[torch.Generator] | None = None):
        self.sample = sample
        self.generators = generators
        self.logprobs: list[torch.Tensor] = []  # T x [n]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float()
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [n, 1]
        if self.sample and self.generators is not None:
            chosen = seeded_tokens((scores - lse).exp_(), self.generators)  # [n, 1]
        elif self.sample:
            chosen = sample_tokens((scores - lse).exp_())  # [n, 1]
        else:
            chosen = scores.argmax(dim=-1, keepdim=True)
        self.logprobs.append((scores.gather(-1, chosen) - lse).squeeze(-1))
        return scores.fill_(-math.inf).scatter_(-1, chosen, 0.0)

    def finish(self, completion: torch.Tensor) -> torch.Tensor:
        """[n, T] log-probs of `completion` (the tokens generate returned: the picked ones, pad after an eos)."""
        assert len(self.logprobs) == completion.shape[1], "one recorded step per generated token"
        if not self.logprobs:
            return torch.zeros(completion.shape, dtype=torch.float32, device=completion.device)
        return torch.stack(self.logprobs, dim=1)


def sample_tokens(probs: torch.Tensor, block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """One token per row of `probs` [n, V] (non-negative, any scale), drawn exactly from it in two stages: a
    block of `block` consecutive tokens by its total mass, then a token inside it by its own. P(block) x
    P(token | block) is the token's probability, and `torch.multinomial` draws V / block + block exponentials per
    row instead of V (448 instead of 49k for SmolLM2: 1.1 ms instead of 43 ms per decoding step at 32 rows on
    2 cores, bench/token_draw.py). [n, 1] long.

    >>> sample_tokens(torch.tensor([[0.0, 0.0, 3.0], [1.0, 0.0, 0.0]]), block=2).tolist()
    [[2], [0]]
    """
    n, vocab = probs.shape
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, -vocab % block))  # zero mass: never drawn
    blocks = probs.view(n, -1, block)  # [n, B, block]
    chosen = torch.multinomial(blocks.sum(-1), 1)  # [n, 1] block
    inner = blocks[torch.arange(n, device=probs.device), chosen.squeeze(1)]  # [n, block]
    return chosen * block + torch.multinomial(inner, 1)


def seeded_tokens(probs: torch.Tensor, generators: list[torch.Generator], block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """One token per row of `probs` [n, V] (non-negative, any scale), row r drawn with two uniforms from its own
    CPU generator `generators[r]`: a block of `block` tokens by its mass, then a token inside it (inverse CDF, the
    two stages of `sample_tokens`). A row's draw depends on its generator alone, never on the other rows of the
    batch, so a multi-turn episode samples the same tokens whichever episodes share its batch or replica. [n, 1] long.

    >>> g = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]
    >>> seeded_tokens(torch.tensor([[0.0, 0.0, 3.0], [1.0, 0.0, 0.0]]), g(), block=2).tolist()
    [[2], [0]]
    """
    u = torch.stack([torch.rand(2, generator=g, dtype=torch.float64) for g in generators]).to(probs.device)  # [n, 2]
    n, vocab = probs.shape
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, -vocab % block))  # zero mass: never drawn
    blocks = probs.view(n, -1, block)  # [n, B, block]
    chosen = _inverse_cdf(blocks.sum(-1), u[:, 0])  # [n] block
    inner = blocks[torch.arange(n, device=probs.device), chosen]  # [n, block]
    return (chosen * block + _inverse_cdf(inner, u[:, 1])).unsqueeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[n] index of the first entry of each row of `weights` [n, K] whose cumulative mass exceeds u [n] (in [0, 1))
    times the row's total: an exact draw for uniform u; a zero-weight entry is never chosen.

    >>> _inverse_cdf(torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), torch.tensor([0.6, 0.0])).tolist()
    [2, 1]
    """
    cdf = weights.double().cumsum(-1)  # [n, K]
    index = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    last = weights.shape[1] - 1 - (weights.flip(-1) > 0).long().argmax(-1)  # u * total rounded up to the total
    return torch.minimum(index, last)


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
