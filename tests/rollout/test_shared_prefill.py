"""The hf rollout's shared prefill (rollout.shared_prefill): one forward pass per distinct prompt, its KV cache
repeated n times, gives the plain path's tokens, masks, finish reasons and (within float noise) sampling log-probs.

The tiny Llama here has 3 layers; PROMPTS are 1 to 8 tokens long (the char tokenizer: one token per character), so
a chunk mixes left-padded rows with a prompt whose cached prefix is all padding.
"""

from __future__ import annotations

import pytest
import torch

from forge.config import LoraConfig, RolloutConfig
from forge.models import add_lora, build_char_tokenizer, build_tiny_model
from forge.records import Rollouts
from forge.rollout import HFBackend, SamplingParams, make_backend
from tests.test_lora import randomise_adapter

torch.set_num_threads(1)
PROMPTS = ["1+2=", "33+4=", "7", "123+456=", "5+5=", "9-8="]


def _tok(pad_is_eos: bool = False):
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    return tok


def _model(tok, layers: int = 3):
    model = build_tiny_model(tok, hidden=32, layers=layers, seed=0)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def _both(model, tok, params: SamplingParams, batch_size: int) -> tuple[Rollouts, Rollouts]:
    """(plain, shared) rollouts of PROMPTS."""
    plain = HFBackend(model, tok, batch_size=batch_size, shared_prefill=False).generate(PROMPTS, params)
    shared = HFBackend(model, tok, batch_size=batch_size, shared_prefill=True).generate(PROMPTS, params)
    return plain, shared


def _assert_same(a: Rollouts, b: Rollouts, atol: float = 1e-5) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert a.finish_reasons == b.finish_reasons and a.texts == b.texts and a.prompts == b.prompts
    torch.testing.assert_close(a.sampling_logprobs, b.sampling_logprobs, rtol=0, atol=atol)


def _forward_shapes(model) -> list[tuple[int, int]]:
    """[rows, tokens] of every forward of the decoder stack (registered on the inner LlamaModel)."""
    shapes: list[tuple[int, int]] = []
    inner = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    inner.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return shapes


def test_greedy_tokens_equal_the_plain_path_across_chunk_boundaries():
    tok = _tok()
    model = _model(tok)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, n=4)
    # batch_size 12: 3 prompts (12 rows) per chunk -> chunks [3, 3] prompts; 10: 2 per chunk -> [2, 2, 2]
    for batch_size in (12, 10, 64):
        plain, shared = _both(model, tok, params, batch_size)
        _assert_same(plain, shared)


def test_each_prompt_is_prefilled_once_and_generate_runs_one_token_wide():
    tok = _tok()
    model = _model(tok)
    shapes = _forward_shapes(model)
    HFBackend(model, tok, batch_size=8).generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0.0, n=4))
    # 2 prompts per chunk: prefill [2, L - 1] of the chunk's width L, then 3 generate steps of [8, 1]
    widths = [len(p) for p in PROMPTS]  # one token per character
    expected = []
    for i in range(0, len(PROMPTS), 2):
        expected += [(2, max(widths[i : i + 2]) - 1)] + [(8, 1)] * 3
    assert shapes == expected


def test_seeded_sampling_draws_the_same_tokens_when_chunks_match():
    """batch_size a multiple of n: the chunks hold the same rows in both paths, so the same multinomial draws."""
    tok = _tok()
    model = _model(tok)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, n=4, seed=5)
    for batch_size in (8, 64):
        plain, shared = _both(model, tok, params, batch_size)
        _assert_same(plain, shared)
        assert (shared.sampling_logprobs[shared.completion_mask == 1] < 0).all()


def test_seeded_sampling_with_a_batch_size_that_splits_groups():
    """batch_size 10, n 4: the plain path draws in chunks of [10, 10, 4] rows, the shared one in [8, 8, 8] (whole
    groups: 10 // 4 = 2 prompts), so the RNG stream is split differently and the tokens differ; they equal the plain
    path run with batch_size 8, whose chunks are the shared path's."""
    tok = _tok()
    model = _model(tok)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=5)
    shared = HFBackend(model, tok, batch_size=10).generate(PROMPTS, params)
    same_chunks = HFBackend(model, tok, batch_size=8, shared_prefill=False).generate(PROMPTS, params)
    _assert_same(same_chunks, shared)
    again = HFBackend(model, tok, batch_size=10).generate(PROMPTS, params)
    _assert_same(shared, again, atol=0.0)


def test_pad_is_eos_masks_and_finish_reasons_are_the_plain_paths():
    tok = _tok(pad_is_eos=True)
    model = _model(tok)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=4, seed=1)
    plain, shared = _both(model, tok, params, batch_size=8)
    _assert_same(plain, shared)
    assert "stop" in shared.finish_reasons  # the eos case is exercised
    for ids, m, reason in zip(shared.completion_ids, shared.completion_mask, shared.finish_reasons, strict=True):
        n = int(m.sum())
        if reason == "stop":  # the sampled eos stays inside the mask although it is also the pad token
            assert int(ids[n - 1]) == tok.eos_token_id and (ids[: n - 1] != tok.eos_token_id).all()


def test_one_token_prompts_run_the_plain_way():
    tok = _tok()
    model = _model(tok)
    shapes = _forward_shapes(model)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, n=3, seed=2)
    prompts = ["7", "8"]
    shared = HFBackend(model, tok, batch_size=64).generate(prompts, params)
    assert shapes[0] == (6, 1)  # no prefill pass: generate's own, over the [6, 1] expanded prompts
    plain = HFBackend(model, tok, batch_size=64, shared_prefill=False).generate(prompts, params)
    _assert_same(plain, shared, atol=0.0)


@pytest.mark.parametrize("setting", ["cache_implementation", "use_cache"])
def test_a_model_generate_builds_its_own_cache_for_runs_the_plain_way(setting):
    tok = _tok()
    model = _model(tok)
    if setting == "cache_implementation":
        model.generation_config.cache_implementation = "static"  # generate refuses a cache passed beside it
    else:
        model.generation_config.use_cache = False
    shapes = _forward_shapes(model)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, n=2)
    shared = HFBackend(model, tok, batch_size=64).generate(PROMPTS[:2], params)
    assert shapes[0] == (4, 5)  # generate's own prefill over the expanded [4, 5] prompts
    plain = HFBackend(model, tok, batch_size=64, shared_prefill=False).generate(PROMPTS[:2], params)
    _assert_same(plain, shared, atol=0.0)


def test_n_1_never_passes_a_cache(monkeypatch):
    tok = _tok()
    model = _model(tok)
    seen = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.append("cache" in kw) or real(**kw))
    HFBackend(model, tok).generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0.0, n=1))
    HFBackend(model, tok).generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=0))
    assert seen == [False, True]


def test_lora_model_shares_its_prefill_too():
    tok = _tok()
    model = add_lora(_model(tok), LoraConfig(rank=4))
    randomise_adapter(model)  # B != 0: the adapter changes the logits, so a cache without it would show
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=4)
    shapes = _forward_shapes(model)
    plain, shared = _both(model, tok, params, batch_size=6)
    _assert_same(plain, shared)
    assert (2, 4) in shapes  # the shared run's first chunk ("1+2=", "33+4=") was prefilled once: [2, 5 - 1]


def test_sliding_window_model():
    """Mistral with a 3-token window (prompts up to 8 tokens): its DynamicCache keeps sliding layers, which
    repeat and continue like full ones."""
    from transformers import MistralConfig, MistralForCausalLM

    tok = _tok()
    config = MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, sliding_window=3, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MistralForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    for temperature in (0.0, 1.0):
        plain, shared = _both(model, tok, SamplingParams(max_new_tokens=10, temperature=temperature, n=4, seed=3), 8)
        _assert_same(plain, shared)


def test_bf16_autocast_prefills_under_autocast_too():
    """Forced on (this CPU may lack bf16 units, where the config would turn it off): the prefill runs under the same
    autocast as generate, so the tokens match and the log-probs agree to bf16 noise (measured 1e-3)."""
    tok = _tok()
    model = _model(tok)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=3)
    plain = HFBackend(model, tok, batch_size=8, shared_prefill=False)
    shared = HFBackend(model, tok, batch_size=8)
    plain.autocast_bf16 = shared.autocast_bf16 = True
    _assert_same(plain.generate(PROMPTS, params), shared.generate(PROMPTS, params), atol=1e-2)


def test_config_reaches_the_backend():
    tok = _tok()
    model = _model(tok, layers=1)
    assert RolloutConfig().shared_prefill is True
    assert make_backend("hf", model, tok).shared_prefill is True
    assert make_backend("hf", model, tok, rollout=RolloutConfig(shared_prefill=False)).shared_prefill is False
