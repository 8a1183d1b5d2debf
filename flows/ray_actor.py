"""The one Ray actor class: a process that hosts one `forge.workers` worker for the whole run.

Kept apart from `flows.ray_exec` because it is also imported by the vLLM venv's python (rollout actors with
`rollout.backend=vllm`), which has ray, torch, transformers and vllm but not Prefect: this module imports only
the standard library and ray at the top, and forge's worker only once `start` runs, after the environment the
plan gives this process (devices, threads) is set — CUDA must not start before CUDA_VISIBLE_DEVICES is.
"""

from __future__ import annotations

import importlib
import os
import socket

import ray

WORKERS = {
    # each built from the run config by its factory in `forge.compose` (the workers take their own sections)
    "rollout": "forge.compose:rollout_worker",
    "reward": "forge.compose:reward_worker",
    "update": "forge.compose:trainer_worker",
    "teacher": "forge.compose:teacher_worker",
}


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class StageActor:
    """`start(stage, *args, **kwargs)` builds the worker; `call(method, *args)` runs one of its methods."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        self.worker = None

    def start(self, stage: str, *args, **kwargs) -> dict:
        module, name = WORKERS[stage].split(":")
        self.worker = getattr(importlib.import_module(module), name)(*args, **kwargs)
        return self.where()

    def call(self, method: str, *args, **kwargs):
        """The worker's `method`; a dotted name reaches into it (tests call `backend.generate_ids` this way)."""
        target = self.worker
        for name in method.split("."):
            target = getattr(target, name)
        return target(*args, **kwargs)

    def where(self) -> dict:
        info = {"pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        if self.worker is not None:
            info = self.worker.where()
        return {**info, "node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_address()}

    def rendezvous(self) -> tuple[str, int]:
        """An address and a free port on this node for the torch.distributed group that rank 0 will host."""
        ip = node_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


@ray.remote(num_cpus=0, max_retries=0)
def reserved_gpu_ids() -> list[str]:
    """The GPU ids Ray gave this task: run in a placement-group bundle asking for all of its GPUs, the ids the bundle
    reserved on its node (`flows.ray_reserve`)."""
    return [str(i) for i in ray.get_gpu_ids()]


def node_address() -> str:
    """This node's address as the cluster knows it (127.0.0.1 for a private local instance)."""
    node_id = ray.get_runtime_context().get_node_id()
    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "127.0.0.1")
