"""The vllm rollout backend in a Ray actor run by .venv-vllm's python (`make vllm-env`), against the hf backend.

One engine actor serves the whole module (it takes ~20-40 s to start on 2 cores); the tests run in file order and
the weight-sync test moves the engine to policy version 1 last. The engine starts from the config's tiny model and
is then given the weights of `_tiny()` (larger random weights, so greedy decoding varies by prompt and stops on
eos for some), the way a run's rollout actors receive the trainer's weights.
"""

from __future__ import annotations

import copy
import os

import pytest
import ray
import torch

from flows.ray_actor import StageActor
from forge.config import RolloutConfig, RunConfig
from forge.errors import UserError
from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import HFBackend, SamplingParams
from forge.rollout.vllm import REPO, VLLMBackend, assemble, engine_env, vllm_python
from forge.trainer import token_logprobs

pytestmark = pytest.mark.slow
PROMPTS = ["1+2=", "33+4=", "5+5=", "hello world, "]  # different lengths: left padding is exercised


def _cfg() -> RunConfig:
    cfg = RunConfig()
    cfg.model.path, cfg.model.tiny.hidden, cfg.model.tiny.layers, cfg.model.tiny.head_dim = "tiny-random", 64, 2, 32
    cfg.rollout.backend = "vllm"
    return cfg


def _tiny(seed: int = 0):
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, hidden=64, layers=2, seed=seed, head_dim=32)  # vLLM's CPU attention: head >= 32
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2, generator=g)
        model.model.embed_tokens.weight[tok.eos_token_id] *= 3
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval(), tok


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(hf backend, engine actor) over the same weights; the actor is killed at the end of the module."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    cfg = _cfg()
    env = {**engine_env(cfg.rollout, 0), "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    actor = StageActor.options(runtime_env={"py_executable": str(vllm_python()), "env_vars": env}).remote(env)
    where = ray.get(actor.start.remote("rollout", cfg, work_dir=str(tmp_path_factory.mktemp("vllm"))))
    model, tok = _tiny()
    ray.get(actor.call.remote("load_weights", _state(model), 0))
    yield HFBackend(model, tok), actor, where
    ray.kill(actor)
    ray.shutdown()


def _generate(actor, params: SamplingParams, version: int = 0, prompts=PROMPTS):
    return ray.get(actor.call.remote("generate", prompts, params, version))


def _greedy(backend_or_actor, max_new_tokens=12, version: int = 0):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=1)
    if isinstance(backend_or_actor, HFBackend):
        return backend_or_actor.generate(PROMPTS, params)
    return _generate(backend_or_actor, params, version)


def _assert_same_tokens(a, b):
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.texts == b.texts and a.finish_reasons == b.finish_reasons and a.prompts == b.prompts


def test_engine_runs_in_the_vllm_venv(pair):
    _, _, where = pair
    assert where["backend"] == "vllm" and where["stage"] == "rollout"
    assert where["python"] == str(vllm_python()) and where["pid"] != os.getpid()


def test_greedy_tokens_match_hf(pair):
    hf, actor, _ = pair
    a, b = _greedy(hf), _greedy(actor)
    _assert_same_tokens(a, b)
    assert b.policy_version == 0 and b.group_size == 1
    assert set(b.finish_reasons) == {"stop", "length"}  # both paths compared (eos kept in the mask, length cap)
    assert len(set(b.texts)) == len(PROMPTS)


def test_eos_kept_and_finish_reasons():
    """Rows that stopped end with the eos inside the mask; rows that hit the cap have exactly max_new_tokens."""
    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    completions = [
        {"token_ids": [20, eos], "logprobs": [-1.0, -2.0]},
        {"token_ids": [21, 22, 23], "logprobs": [-0.5, -0.5, -0.5]},
    ]
    ro = assemble(tok, ["a", "bb"], [[30], [31, 32]], completions, group_size=1, version=3)
    assert ro.completion_ids.tolist() == [[20, eos, tok.pad_token_id], [21, 22, 23]]
    assert ro.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert ro.prompt_ids.tolist() == [[tok.pad_token_id, 30], [31, 32]] and ro.prompt_mask.tolist() == [[0, 1], [1, 1]]
    assert ro.sampling_logprobs.tolist() == [[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]]
    assert ro.finish_reasons == ["stop", "length"] and ro.policy_version == 3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_are_the_sampling_distribution(pair, temperature):
    """processed_logprobs: vLLM's log-prob of each sampled token equals the trainer's recomputation at the same
    temperature (so the PPO ratio starts at 1), as the hf backend's does."""
    hf, actor, _ = pair
    ro = _generate(actor, SamplingParams(max_new_tokens=8, temperature=temperature, n=3, seed=0))
    assert ro.num_completions == 12 and ro.group_size == 3
    with torch.no_grad():
        lp = token_logprobs(
            hf.model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, temperature=temperature
        ).logp
    m = ro.completion_mask.bool()
    assert torch.allclose(lp[m], ro.sampling_logprobs[m], atol=1e-4)
    assert (ro.sampling_logprobs[~m] == 0).all()


def test_top_p_logprobs_are_renormalised_over_the_nucleus(pair):
    """With top-p the log-prob is under the truncated, renormalised distribution that was sampled from: the same
    as transformers' temperature + top-p warpers (what the hf backend reports) give on the same tokens."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    hf, actor, _ = pair
    ro = _generate(actor, SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.8, n=3, seed=1))
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], dim=1)
    attn = torch.cat([ro.prompt_mask, ro.completion_mask], dim=1)
    with torch.no_grad():
        logits = hf.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    p, (n, t) = ro.prompt_ids.shape[1], ro.completion_ids.shape
    flat = logits[:, p - 1 : -1].reshape(n * t, -1)  # [N*T, vocab] logits that predicted each completion token
    flat = TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, flat))
    expected = flat.log_softmax(-1).gather(-1, ro.completion_ids.reshape(-1, 1)).view(n, t)
    m = ro.completion_mask.bool()
    assert torch.allclose(expected[m], ro.sampling_logprobs[m], atol=1e-4)
    raw = (logits[:, p - 1 : -1] / 0.7).log_softmax(-1).gather(-1, ro.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert (ro.sampling_logprobs[m] > raw[m] + 1e-3).any(), "renormalising over the nucleus raises some log-probs"


def test_seeded_sampling_is_reproducible_and_does_not_depend_on_the_split(pair):
    """Row i is seeded `seed + i`: the same seed gives the same completions, the G samples of a prompt differ, and
    two halves sent with seeds `seed` and `seed + 2G` (two replicas) give exactly what one call gives."""
    _, actor, _ = pair
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=123)
    a, b = _generate(actor, params), _generate(actor, params)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert len(set(a.texts[:4])) > 1, "the G samples of a prompt must use different seeds"
    first = _generate(actor, params, prompts=PROMPTS[:2])
    second = _generate(actor, SamplingParams(8, 1.0, n=4, seed=123 + 2 * 4), prompts=PROMPTS[2:])
    assert first.texts + second.texts == a.texts


def test_generate_ids_samples_token_contexts_like_hf_and_seeds_each_request(pair):
    """Multi-turn episodes' sampler: token contexts in (TokensPrompt, never re-tokenised), the new tokens and their
    log-probs out. Greedy tokens equal hf's `generate_ids`; sampled log-probs are the trainer's recomputation on the
    whole context; request i draws from `seeds[i]` alone, so two halves give what one call gives."""
    hf, actor, _ = pair
    tok = hf.tokenizer
    contexts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    contexts[1] = contexts[1] + [tok.eos_token_id] + contexts[2]  # a later turn: an eos inside the context
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)  # turns of 6, 4, 1 and 6 tokens (two end in eos)
    got = ray.get(actor.call.remote("backend.generate_ids", contexts, greedy))
    want = hf.generate_ids(contexts, greedy)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert {ids[-1] == tok.eos_token_id for ids, _ in got} == {True, False}  # eos kept; the length cap
    params, seeds = SamplingParams(max_new_tokens=8, temperature=1.0), [40, 41, 42, 43]
    whole = ray.get(actor.call.remote("backend.generate_ids", contexts, params, seeds))
    halves = [ray.get(actor.call.remote("backend.generate_ids", contexts[i : i + 2], params, seeds[i : i + 2]))
              for i in (0, 2)]  # fmt: skip
    assert [ids for ids, _ in whole] == [ids for ids, _ in halves[0] + halves[1]]
    assert len({tuple(ids) for ids, _ in whole}) > 1
    again = ray.get(actor.call.remote("backend.generate_ids", contexts, params, [s + 1000 for s in seeds]))
    assert [ids for ids, _ in again] != [ids for ids, _ in whole]  # another turn's seeds: other draws
    for ctx, (ids, logprobs) in zip(contexts, whole, strict=True):
        full = torch.tensor([ctx + ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf.model(input_ids=full).logits[0, len(ctx) - 1 : -1], -1)
        assert torch.allclose(lp.gather(-1, torch.tensor(ids).unsqueeze(1)).squeeze(1), torch.tensor(logprobs),
                              atol=1e-4)  # fmt: skip


def test_stale_version_is_refused(pair):
    _, actor, _ = pair
    with pytest.raises(ray.exceptions.RayTaskError, match="holds policy version 0, asked for 5"):
        _greedy(actor, version=5)


def test_weight_sync_changes_greedy_output_like_hf(pair):
    """A real update (Adam steps towards a target answer) changes greedy decoding; after load_weights the engine
    decodes exactly what hf decodes with the new weights, at the new policy version."""
    hf, actor, _ = pair
    before = _greedy(hf)
    model, tok = hf.model, hf.tokenizer
    enc = tok([p + "77" for p in PROMPTS], return_tensors="pt", padding=True, add_special_tokens=False)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    model.train()
    for _ in range(10):
        loss = model(**enc, labels=enc.input_ids.masked_fill(enc.attention_mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    seconds = ray.get(actor.call.remote("load_weights", _state(model), 1))
    after_hf, after_vllm = _greedy(hf), _greedy(actor, version=1)
    assert not torch.equal(before.completion_ids, after_hf.completion_ids), "the update did not change decoding"
    _assert_same_tokens(after_hf, after_vllm)
    assert after_vllm.policy_version == 1 and 0 < seconds < 30


def test_missing_vllm_env_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.delenv("FORGEWEAVE_VLLM_PYTHON", raising=False)
    with pytest.raises(UserError, match="make vllm-env"):
        vllm_python(str(tmp_path / "nope" / "python"))


def test_unsupported_head_size_is_a_user_error(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden=64, layers=1, head_dim=16)
    with pytest.raises(UserError, match="model.tiny.head_dim=32"):
        VLLMBackend(copy.deepcopy(model), tok, RolloutConfig(backend="vllm"), tmp_path)
