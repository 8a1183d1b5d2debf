"""The hf rollout backend: grouping, masks with eos (also when pad == eos), logprobs, reproducibility."""

import torch

from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import HFBackend, SamplingParams
from forge.rollout.hf import completion_mask
from forge.trainer import token_logprobs


def _backend(seed=0, pad_is_eos=False):
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    model = build_tiny_model(tok, hidden=32, layers=1, seed=seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return HFBackend(model, tok, batch_size=5), tok


PROMPTS = ["1+2=", "33+4=", "5+5="]


def test_groups_shapes_and_version():
    backend, _ = _backend()
    backend.sync_weights(backend.model, 7)
    ro = backend.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=4))
    assert ro.num_completions == 12 and ro.group_size == 4 and ro.policy_version == 7
    assert ro.prompts == [p for p in PROMPTS for _ in range(4)]
    assert ro.completion_ids.shape == ro.completion_mask.shape == ro.sampling_logprobs.shape
    assert ro.completion_ids.shape[1] <= 6
    assert ro.prompt_ids.shape == ro.prompt_mask.shape
    assert all(r in ("stop", "length") for r in ro.finish_reasons)
    assert (ro.sampling_logprobs[ro.completion_mask == 0] == 0).all()
    assert (ro.sampling_logprobs[ro.completion_mask == 1] <= 0).all()


def test_seeded_sampling_is_reproducible():
    backend, _ = _backend()
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=3)
    torch.manual_seed(123)
    a = backend.generate(PROMPTS, params)
    torch.manual_seed(123)
    b = backend.generate(PROMPTS, params)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts


def test_greedy_matches_plain_generate():
    backend, tok = _backend()
    ro = backend.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0, n=1))
    for i, p in enumerate(PROMPTS):
        enc = tok([p], return_tensors="pt", add_special_tokens=False)
        out = backend.model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        ids = out[0, enc.input_ids.shape[1] :]
        n = int(ro.completion_mask[i].sum())
        assert ro.completion_ids[i, :n].tolist() == ids[:n].tolist()


def test_sampling_logprobs_match_trainer_logprobs():
    """At temperature 1 and fp32 the sampler's logprobs equal the trainer's recomputation (ratio starts at 1)."""
    backend, _ = _backend()
    torch.manual_seed(0)
    ro = backend.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=2))
    with torch.no_grad():
        lp = token_logprobs(backend.model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask).logp
    m = ro.completion_mask.bool()
    assert torch.allclose(lp[m], ro.sampling_logprobs[m], atol=1e-4)


def test_temperature_is_applied_in_both_places():
    backend, _ = _backend()
    torch.manual_seed(0)
    ro = backend.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.5, n=2))
    with torch.no_grad():
        lp = token_logprobs(
            backend.model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, temperature=0.5
        ).logp
    m = ro.completion_mask.bool()
    assert torch.allclose(lp[m], ro.sampling_logprobs[m], atol=1e-4)


def test_eos_kept_when_pad_is_eos():
    """pad == eos: the sampled eos stays inside the mask (a `token != pad` mask would drop it)."""
    mask = completion_mask(torch.tensor([[7, 2, 2, 2], [7, 8, 9, 10]]), eos_id=2)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    backend, tok = _backend(pad_is_eos=True)
    torch.manual_seed(1)
    ro = backend.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, n=4))
    for ids, m, reason in zip(ro.completion_ids, ro.completion_mask, ro.finish_reasons, strict=True):
        n = int(m.sum())
        if reason == "stop":
            assert int(ids[n - 1]) == tok.eos_token_id
            assert (ids[: n - 1] != tok.eos_token_id).all()
