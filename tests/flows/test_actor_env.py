"""What a stage actor starts with (issue 45's review): its environment extends PYTHONPATH instead of replacing it, and
a vLLM rollout actor reads only the policy's config (no weight file, no host copy of the policy)."""

from __future__ import annotations

import os

from flows.ray_exec import REPO, actor_env


def test_another_venvs_actor_extends_the_drivers_pythonpath():
    environ = {"PYTHONPATH": "/site/extra:/more", "HOME": "/home/u", "NCCL_SOCKET_IFNAME": "ens5",
               "FORGEWEAVE_WEIGHT_SECRET": "ab"}  # fmt: skip
    env = actor_env(environ, {"CUDA_VISIBLE_DEVICES": "1"}, python="/venv-vllm/bin/python")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/site/extra", "/more"]  # the user's entries stay
    assert env["NCCL_SOCKET_IFNAME"] == "ens5" and env["FORGEWEAVE_WEIGHT_SECRET"] == "ab"
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "HOME" not in env  # the plan's; nothing else of the driver's
    assert actor_env({}, {}, python="/v/bin/python")["PYTHONPATH"] == str(REPO)
    assert "PYTHONPATH" not in actor_env(environ, {})  # the main venv's actor: Ray's own environment


def test_a_vllm_rollout_actor_reads_the_config_only(monkeypatch):
    import forge.workers
    from forge.compose import rollout_worker
    from forge.presets import tiny

    seen = {}

    def backend(name, model, tokenizer, **kwargs):
        seen["name"], seen["devices"] = name, {p.device.type for p in model.parameters()}
        seen["config"] = model.config.hidden_size
        return object()

    monkeypatch.setattr(forge.workers, "make_backend", backend)
    cfg = tiny()
    cfg.rollout.backend, cfg.model.tiny.head_dim = "vllm", 32
    worker = rollout_worker(cfg)
    assert seen == {"name": "vllm", "devices": {"meta"}, "config": cfg.model.tiny.hidden}  # no weights were made
    assert worker.model is None
