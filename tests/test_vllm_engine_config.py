"""The vLLM engine's configuration without vLLM: engine arguments from config (dtype, memory controls), the dtype
of published weights, sleep mode around the update (with a stand-in engine that records calls: vLLM's sleep mode is
CUDA-only), level 2 before a sync and the engine's refusal to sample until it lands, the colocated trainer rank's
release of its gradients and cached blocks before the engine wakes, the plan's colocation reaching the rollout
process's environment."""

from __future__ import annotations

import pytest
import torch

import forge.workers as workers
from forge.compose import rollout_worker
from forge.config import RolloutConfig, RunConfig
from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import SamplingParams
from forge.rollout.config import VllmConfig
from forge.rollout.vllm import VLLMBackend, engine_dtype, engine_kwargs, sleep_level, wants_sleep
from tests.grpo_parts import TrainerWorker

torch.set_num_threads(1)


def test_engine_kwargs_on_cuda_carry_dtype_and_memory_controls():
    vllm = VllmConfig(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=2048)
    cfg = RolloutConfig(backend="vllm", vllm=vllm, tensor_parallel_size=2)
    dtype = engine_dtype(cfg, torch.float32, cuda=True)
    kw = engine_kwargs(cfg, "/m", dtype, seed=7, cuda=True, sleep=True)
    assert kw == {
        "model": "/m", "load_format": "dummy", "worker_extension_cls": "forge.rollout.vllm.WeightReceiver",
        "dtype": "bfloat16", "seed": 7, "tensor_parallel_size": 2, "distributed_executor_backend": "mp",
        "logprobs_mode": "processed_logprobs", "generation_config": "vllm", "enable_prefix_caching": True,
        "max_model_len": 2048, "gpu_memory_utilization": 0.3, "enforce_eager": True, "enable_sleep_mode": True,
    }  # fmt: skip


def test_engine_kwargs_on_cpu_keep_the_policy_dtype_and_no_gpu_arguments():
    cfg = RolloutConfig(backend="vllm")
    kw = engine_kwargs(cfg, "/m", engine_dtype(cfg, torch.float32, cuda=False), seed=0, cuda=False)
    assert kw["dtype"] == "float32" and "max_model_len" not in kw and "distributed_executor_backend" not in kw
    assert not {"gpu_memory_utilization", "enforce_eager", "enable_sleep_mode"} & set(kw)
    assert engine_dtype(RolloutConfig(vllm=VllmConfig(dtype="float16")), torch.float32, cuda=False) == torch.float16
    assert engine_dtype(RolloutConfig(vllm=VllmConfig(dtype="float32")), torch.float32, cuda=True) == torch.float32


def _cfg(backend="vllm", **vllm) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.backend = backend
    for k, v in vllm.items():
        setattr(cfg.rollout.vllm, k, v)
    return cfg


def _sleeps(cfg: RunConfig) -> tuple:
    return cfg.rollout, cfg.algo.max_staleness


def test_sleep_only_for_a_colocated_on_policy_engine_on_cuda():
    assert wants_sleep(*_sleeps(_cfg()), True, "update,evaluate")
    assert not wants_sleep(*_sleeps(_cfg()), True, "evaluate")  # own GPUs: nothing to free memory for
    asynchronous = _cfg()
    asynchronous.algo.max_staleness = 1
    assert not wants_sleep(*_sleeps(asynchronous), True, "update")  # it samples during the update
    assert wants_sleep(*_sleeps(_cfg(sleep="on")), True, "")
    assert not wants_sleep(*_sleeps(_cfg(sleep="off")), True, "update")
    assert not wants_sleep(*_sleeps(_cfg(sleep="on")), False, "update")  # CPU engines have no sleep mode
    assert not wants_sleep(*_sleeps(_cfg("hf", sleep="on")), True, "update")


def _trainer_worker(cfg: RunConfig) -> TrainerWorker:
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    return TrainerWorker(cfg, model=build_tiny_model(tok, hidden=32, layers=1, seed=0), tokenizer=tok)


def test_published_weights_are_in_the_engine_dtype():
    w = _trainer_worker(_cfg(dtype="bfloat16"))
    published = w.weights()
    assert {v.dtype for v in published.values()} == {torch.bfloat16}
    own = w.trainer.full_weights()
    assert {v.dtype for v in own.values()} == {torch.float32}  # the trainer keeps fp32 masters
    assert torch.equal(published["model.embed_tokens.weight"], own["model.embed_tokens.weight"].bfloat16())
    assert {v.dtype for v in _trainer_worker(_cfg()).weights().values()} == {torch.float32}  # auto on CPU
    assert {v.dtype for v in _trainer_worker(_cfg("hf")).weights().values()} == {torch.float32}


class FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, fn, args=(), kwargs=None):
        if kwargs is None:  # a method of the worker extension, by name
            self.calls.append((fn,))
        else:
            self.calls.append(("reload", {v.dtype for v in kwargs["tensors"].values()}))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _fake_backend(sleep_mode: bool) -> VLLMBackend:
    b = object.__new__(VLLMBackend)  # no engine: the weight-load and sleep sequencing only
    b.llm, b.dtype, b.sleep_mode, b.asleep, b.policy_version = FakeLLM(), torch.bfloat16, sleep_mode, False, 0
    b.loaded, b.dropped, b.tokenizer = True, False, build_char_tokenizer()
    return b


def test_a_sleeping_engine_wakes_weights_loads_then_wakes_its_kv_cache():
    b = _fake_backend(sleep_mode=True)
    b.sleep()
    b.sync_weights({"w": torch.ones(2), "step": torch.tensor(3)}, version=1)
    assert b.llm.calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("reload", {torch.bfloat16, torch.int64}),  # floats cast to the engine dtype, integers untouched
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert b.policy_version == 1 and not b.asleep
    idle = _fake_backend(sleep_mode=False)
    idle.sleep()
    idle.wake()
    assert idle.llm.calls == []  # without sleep mode (CPU, or not colocated) nothing changes


def test_level_2_drops_the_weights_until_a_sync_lands_which_wakes_weights_loads_then_wakes_the_cache():
    b = _fake_backend(sleep_mode=True)
    b.sleep(2)
    assert not b.loaded and b.asleep
    with pytest.raises(RuntimeError, match=r"dropped its weights \(sleep level 2\) after version 0: sync the next"):
        b.generate(["1+1="], SamplingParams(max_new_tokens=2))
    b.receive_weights(1)
    assert b.llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("forgeweave_receive_weights",),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert b.loaded and not b.asleep and not b.dropped and b.policy_version == 1
    b.llm.calls.clear()
    b.sleep(1)  # after an evaluate: the weights stay (in host memory) and the next generate wakes everything
    assert b.loaded and b.llm.calls == [("sleep", 1)]
    b.wake()
    assert b.llm.calls[-1] == ("wake_up", None) and not b.asleep


def test_level_2_only_where_a_sync_comes_next():
    assert (
        sleep_level(_cfg().algo.max_staleness, "update,evaluate") == 2
    )  # on-policy, colocated: update and sync come next
    assert sleep_level(_cfg().algo.max_staleness, "evaluate") == 1
    asynchronous = _cfg()
    asynchronous.algo.max_staleness = 1  # (with rollout.vllm.sleep=on) another generate may come first
    assert sleep_level(asynchronous.algo.max_staleness, "update") == 1


def test_a_colocated_trainer_rank_releases_gradients_then_its_cache_after_the_step(monkeypatch):
    """`release_memory` runs at the end of `step` on a rank that shares its GPU with an engine: gradients dropped
    first (set to None), then the allocator's cache; torch.cuda.empty_cache stands in for CUDA, recording what the
    gradients were when it was called."""
    from tests.test_trainer import make_rollouts

    assert workers.releases_memory(True, "rollout") and not workers.releases_memory(True, "reward")
    tok = build_char_tokenizer()
    w = TrainerWorker(_cfg("hf"), model=build_tiny_model(tok, hidden=32, layers=1, seed=0), tokenizer=tok)
    assert not w.releases  # this machine has no CUDA
    seen = []
    params = list(w.trainer.unwrapped.parameters())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append([p.grad is None for p in params]))
    w.releases = True
    w.step(make_rollouts(tok), torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0]))
    assert seen == [[True] * len(params)]  # called once, after every gradient was released
    w.releases = False
    w.step(make_rollouts(tok), torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0]))
    assert len(seen) == 1 and any(p.grad is not None for p in params)  # not colocated: the gradients stay


class FakeBackend:
    policy_version = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        from forge.rollout.vllm import assemble

        self.calls.append("generate")
        tok = build_char_tokenizer()
        ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        done = [{"token_ids": [5, tok.eos_token_id], "logprobs": [-0.5, -0.1], "finish_reason": "stop"}] * len(ids)
        return assemble(tok, prompts, ids, done, 1, self.policy_version)

    def sleep(self, level=1):
        self.calls.append(f"sleep {level}")

    def sync_weights(self, weights, version):
        self.calls.append("sync_weights")


def test_rollout_worker_puts_a_colocated_engine_to_sleep_after_sampling(monkeypatch):
    fake = FakeBackend()
    monkeypatch.setattr(workers, "make_backend", lambda *a, **k: fake)
    monkeypatch.setattr(workers, "rollout_sleeps", lambda rollout, max_staleness: True)
    monkeypatch.setenv("FORGEWEAVE_COLOCATED", "update")  # the plan put the update on this GPU: level 2
    tok = build_char_tokenizer()
    worker = rollout_worker(_cfg(), model=build_tiny_model(tok, hidden=32, layers=1), tokenizer=tok)
    worker.generate(["1+1="], SamplingParams(max_new_tokens=2), version=0)
    worker.load_weights({}, 1)
    assert fake.calls == ["generate", "sleep 2", "sync_weights"]


def test_plan_colocation_reaches_the_gpu_processes_environment():
    from weaver.apply import actor_specs
    from weaver.plan import plan, stage_needs
    from weaver.pools import pools_from_dicts

    pools = pools_from_dicts([{"name": "cpu", "kind": "cpu", "host": "h", "cpu_cores": 4, "memory_gib": 32},
                              {"name": "gpu", "kind": "gpu", "host": "h", "devices": [0], "memory_gib": 80}],
                             source="test")  # fmt: skip
    p = plan(stage_needs(500_000_000, gpu=True), pools)
    rollout = actor_specs(p, "rollout", {"cpu": 4, "gpu": 4})[0]
    assert rollout.env["FORGEWEAVE_COLOCATED"].split(",")[0] == "update"
    assert "FORGEWEAVE_COLOCATED" not in actor_specs(p, "reward", {"cpu": 4, "gpu": 4})[0].env
