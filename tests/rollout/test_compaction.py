"""The hf rollout's compaction (rollout.compact_every): sequences that have ended leave the batch between generate
calls, and the rest decode on from their KV cache. Greedy tokens, masks and log-probs equal one uninterrupted
generate; the decoder then runs fewer rows; seeded sampling repeats itself.

The tiny random Llama with the character tokenizer: its completions end at an eos at very different lengths.
"""

from __future__ import annotations

import pytest
import torch

from forge.rollout import HFBackend, SamplingParams
from tests.rollout.test_shared_prefill import PROMPTS, _assert_same, _forward_shapes, _model, _tok

torch.set_num_threads(1)


def _biased_to_end(model, tok, bias: float = 5.0):
    """Raise eos's logit so completions end at many different lengths (the random model rarely stops)."""
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += bias * model.lm_head.weight.std()
    return model


@pytest.mark.parametrize("shared_prefill", [False, True])
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_greedy_tokens_are_those_of_one_generate_and_ended_rows_stop_being_computed(shared_prefill, pad_is_eos):
    tok = _tok(pad_is_eos)
    model = _biased_to_end(_model(tok), tok)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=3)
    shapes = _forward_shapes(model)
    once = HFBackend(model, tok, shared_prefill=shared_prefill, compact_every=0).generate(PROMPTS, params)
    once_rows = [rows for rows, tokens in shapes if tokens == 1]  # decoding steps: one token per row
    shapes.clear()
    compacted = HFBackend(model, tok, shared_prefill=shared_prefill, compact_every=2).generate(PROMPTS, params)
    compacted_rows = [rows for rows, tokens in shapes if tokens == 1]
    _assert_same(once, compacted)
    lengths = once.completion_mask.sum(1)
    assert len(set(lengths.tolist())) >= 3 and lengths.max() > 4  # ends at several lengths: something to drop
    assert set(once_rows) == {len(PROMPTS) * 3}  # without compaction every step computes every row
    # with it, each 2-token segment computes only the rows live at its start
    live = [int((lengths > t).sum()) for t in range(0, int(lengths.max()), 2)]
    assert sum(compacted_rows) <= 2 * sum(live) and sum(compacted_rows) < sum(once_rows)


def test_seeded_sampling_repeats_and_keeps_the_sampler_log_probs():
    tok = _tok()
    model = _biased_to_end(_model(tok), tok)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, n=4, seed=7)
    a = HFBackend(model, tok, compact_every=3).generate(PROMPTS, params)
    b = HFBackend(model, tok, compact_every=3).generate(PROMPTS, params)
    _assert_same(a, b, atol=0.0)
    m = a.completion_mask.bool()
    assert (a.sampling_logprobs[m] < 0).all() and (a.sampling_logprobs[~m] == 0).all()
