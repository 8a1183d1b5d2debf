"""Memory at long lengths, tested at small ones: the hf rollout keeps the chosen tokens' log-probs step by step
(never the [n, T, vocab] scores), the trainer's chunked fp32 log-softmax equals the full one (values, entropy and
gradients), and rollout.batch_size / eval.batch_size set the sequences per generate() call.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from forge.config import EvalConfig, RolloutConfig
from forge.evaluate import evaluate
from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import SamplingParams, make_backend
from forge.trainer import chunked_logprobs, chunked_scores

torch.set_num_threads(1)
PROMPTS = ["1+2=", "33+4=", "5+5="]


def _tiny():
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, hidden=32, layers=1, seed=0)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def _teacher_forced_logprobs(model, ro, params: SamplingParams) -> torch.Tensor:
    """The rollout's tokens scored afresh: one forward over prompt + completion, the temperature and top-p warpers
    applied to each position's logits, the full [n, T, vocab] log-softmax. [n, T], 0 after eos."""
    P, T = ro.prompt_ids.shape[1], ro.completion_ids.shape[1]
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], dim=1)
    mask = torch.cat([ro.prompt_mask, ro.completion_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    warpers = [TemperatureLogitsWarper(params.temperature), TopPLogitsWarper(params.top_p)]
    logp = torch.zeros(ro.completion_ids.shape)
    for t in range(T):
        scores = logits[:, P - 1 + t].float()
        for warp in warpers:
            scores = warp(ids[:, : P + t], scores)
        logp[:, t] = torch.log_softmax(scores, dim=-1).gather(-1, ro.completion_ids[:, t : t + 1]).squeeze(-1)
    return logp * ro.completion_mask


@pytest.mark.parametrize("compact_every", [0, 2])
@pytest.mark.parametrize("shared_prefill", [False, True])
def test_hf_rollout_streams_the_log_probs_of_the_distribution_it_sampled(compact_every, shared_prefill):
    """What stored [n, T, vocab] scores would give at the sampled tokens, recorded one step at a time."""
    model, tok = _tiny()
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, n=3, seed=11)
    rollout = RolloutConfig(batch_size=64, shared_prefill=shared_prefill, compact_every=compact_every)
    ro = make_backend("hf", model, tok, rollout=rollout).generate(PROMPTS, params)
    mask = ro.completion_mask.bool()
    torch.testing.assert_close(ro.sampling_logprobs, _teacher_forced_logprobs(model, ro, params), rtol=0, atol=1e-5)
    assert (ro.sampling_logprobs[mask] < 0).all() and (ro.sampling_logprobs[~mask] == 0).all()
    assert len({tuple(r) for r in ro.completion_ids.tolist()}) > 3  # sampled: the 3 samples of a prompt differ


def test_hf_rollout_never_asks_generate_for_scores(monkeypatch):
    model, tok = _tiny()
    seen = []
    real = model.generate

    def spy(**kw):
        seen.append((kw.get("output_scores", False), kw.get("output_logits", False)))
        return real(**kw)

    monkeypatch.setattr(model, "generate", spy)
    make_backend("hf", model, tok).generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, seed=1))
    assert seen == [(False, False)]


def _generate_sizes(monkeypatch, model) -> list[int]:
    sizes = []
    real = model.generate

    def spy(**kw):
        sizes.append(kw["input_ids"].shape[0])
        return real(**kw)

    monkeypatch.setattr(model, "generate", spy)
    return sizes


def test_rollout_batch_size_sets_sequences_per_generate_call(monkeypatch):
    model, tok = _tiny()
    sizes = _generate_sizes(monkeypatch, model)
    params = SamplingParams(max_new_tokens=3, n=3, seed=0)  # 9 sequences
    ro = make_backend("hf", model, tok, rollout=RolloutConfig(batch_size=4, shared_prefill=False)).generate(
        PROMPTS, params
    )
    assert sizes == [4, 4, 1] and ro.num_completions == 9
    sizes.clear()  # a shared prefill keeps groups whole: max(1, 4 // 3) = 1 prompt, 3 sequences per call
    make_backend("hf", model, tok, rollout=RolloutConfig(batch_size=4)).generate(PROMPTS, params)
    assert sizes == [3, 3, 3]
    sizes.clear()  # 7 // 3 = 2 prompts per call
    make_backend("hf", model, tok, rollout=RolloutConfig(batch_size=7)).generate(PROMPTS, params)
    assert sizes == [6, 3]


def test_eval_batch_size_sets_sequences_per_generate_call(monkeypatch):
    model, tok = _tiny()
    sizes = _generate_sizes(monkeypatch, model)
    backend = make_backend("hf", model, tok, rollout=RolloutConfig(batch_size=64))
    rows = [{"prompt": p, "model_input": p, "answer": "3"} for p in PROMPTS * 2]  # 6 problems
    report = evaluate(backend, rows, EvalConfig(k=2, batch_size=4, max_new_tokens=3), RolloutConfig())
    # greedy: 6 sequences in calls of 4; pass@2: 12 sequences in calls of 4
    assert sizes == [4, 2, 4, 4, 4] and report["problems"] == 6


def _full(logits, ids, temperature):
    logsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients():
    torch.manual_seed(0)
    n, T, vocab = 3, 10, 50
    base = torch.randn(n, T, vocab, dtype=torch.float64).float()
    ids = torch.randint(0, vocab, (n, T))
    weights = torch.randn(n, T)
    results = {}
    for name, chunk in (("full", None), ("chunked", n * vocab * 3)):  # 3 positions per chunk: 4 chunks
        logits = base.clone().requires_grad_(True)
        if chunk is None:
            logp, entropy = _full(logits, ids, 0.8)
        else:
            out = chunked_logprobs(logits, ids, 0.8, chunk_elements=chunk)
            logp, entropy = out.logp, out.entropy
        (logp * weights).sum().backward()
        results[name] = (logp.detach(), entropy, logits.grad)
    for a, b in zip(results["full"], results["chunked"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not results["chunked"][1].requires_grad  # entropy is reported, never trained on


def test_chunked_scores_equal_the_full_log_softmax_and_its_top_k_among_the_tokenizer_ids():
    torch.manual_seed(0)
    n, T, vocab, tokens = 3, 10, 50, 45  # 5 padding rows past the tokenizer's ids
    logits = torch.randn(n, T, vocab)
    logits[..., tokens:] += 10.0  # the padding rows are the largest: the top k must skip them
    ids = torch.randint(0, tokens, (n, T))
    logsm = torch.log_softmax(logits / 0.8, dim=-1)
    want = logsm[..., :tokens].topk(4, dim=-1)
    for chunk in (None, n * vocab * 3):  # one chunk; 3 positions per chunk (4 chunks)
        kw = {} if chunk is None else {"chunk_elements": chunk}
        logp, values, top_ids = chunked_scores(logits, ids, 0.8, 4, tokens, **kw)
        torch.testing.assert_close(logp, logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1))
        torch.testing.assert_close(values, want.values)
        assert torch.equal(top_ids, want.indices) and int(top_ids.max()) < tokens
        (only,) = chunked_scores(logits, ids, 0.8, **kw)  # k = 0: the sampled tokens' log-probs alone
        torch.testing.assert_close(only, logp)


def test_chunked_logprobs_hold_one_chunk_of_fp32_at_a_time(monkeypatch):
    import forge.trainer as trainer_mod

    widths = []
    real = trainer_mod._chunk_logprobs

    def spy(chunk, ids, temperature, extra_ids=None):
        widths.append(tuple(chunk.shape))
        return real(chunk, ids, temperature, extra_ids)

    monkeypatch.setattr(trainer_mod, "_chunk_logprobs", spy)
    logits = torch.randn(2, 7, 40, dtype=torch.bfloat16)
    out = chunked_logprobs(logits, torch.zeros(2, 7, dtype=torch.long), chunk_elements=2 * 40 * 2)
    assert widths == [(2, 2, 40)] * 3 + [(2, 1, 40)] and out.logp.dtype == torch.float32
