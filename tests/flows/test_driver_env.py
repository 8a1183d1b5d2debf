"""The driver's NCCL/gloo settings reach every stage actor (docs/ray.md, "Network interfaces").

A Ray worker inherits its node's raylet environment, not the driver's, so `NCCL_SOCKET_IFNAME` set where
`forgeweave run` runs reaches the actors only through their `runtime_env` env_vars, which `RayStages._actor` (the one
place the Ray adapter starts an actor) builds. Checked here on what `_actor` hands Ray, with Ray's actor class
replaced by a recorder: no Ray instance is started.
"""

from __future__ import annotations

from types import SimpleNamespace

from flows import ray_exec
from weaver.apply import actor_specs, driver_env
from weaver.plan import plan, stage_needs
from weaver.pools import Pool

POOLS = [Pool("train-a", "gpu", (0, 1), host="train-1", memory_gib=80), Pool("cpu", "cpu", host="gen-1", cpu_cores=4)]
NETWORK = {"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}


class Recorder:
    """Stands in for `StageActor`: records the options of every actor `_actor` starts."""

    started: list[dict] = []

    @classmethod
    def options(cls, **options):
        cls.started.append(options)
        return SimpleNamespace(remote=lambda env: SimpleNamespace(env=env))


def test_driver_side_network_variables_reach_every_actor_and_the_plan_keeps_its_own(monkeypatch):
    for key, value in {**NETWORK, "TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_VISIBLE_DEVICES": "7"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FORGEWEAVE_UNRELATED", "x")
    monkeypatch.setattr(ray_exec, "StageActor", Recorder)
    monkeypatch.setattr(Recorder, "started", [])
    p = plan(stage_needs(500_000_000, rollout_replicas=0, update_processes=2, gpu=True), POOLS)
    rank1 = actor_specs(p, "update", {"train-a": 8, "cpu": 4})[1]
    stages = object.__new__(ray_exec.RayStages)  # only what `_actor` uses: no Ray, no model
    stages.actors, stages.reservation = {}, SimpleNamespace(strategy=lambda spec: "DEFAULT")
    actor = stages._actor(rank1, "update")
    stages._actor(rank1, "rollout", python="/opt/vllm-venv/bin/python")  # a vLLM engine, run by another venv
    for options in Recorder.started:
        env = options["runtime_env"]["env_vars"]
        assert {k: env[k] for k in NETWORK} == NETWORK and env["TORCH_NCCL_BLOCKING_WAIT"] == "1"
        assert env["CUDA_VISIBLE_DEVICES"] == "1"  # the plan's device for rank 1, not the driver's mask
        assert "FORGEWEAVE_UNRELATED" not in env and "PATH" not in env  # only NCCL/gloo settings travel
    assert actor.env == Recorder.started[0]["runtime_env"]["env_vars"]  # the actor sets the same before torch starts
    assert Recorder.started[1]["runtime_env"]["py_executable"] == "/opt/vllm-venv/bin/python"


def test_driver_env_takes_only_nccl_and_gloo_settings():
    env = {**NETWORK, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HOME": "/root", "NCCLX": "no", "MY_NCCL_X": "no"}
    assert driver_env(env) == {**NETWORK, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert driver_env({}) == {}
