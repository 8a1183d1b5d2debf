"""Apply a plan: what each stage's processes get (devices, threads, the pool they must run on). Small pure functions
over a `Plan` returning typed values; the execution layer (flows/) uses them and nothing else re-derives placement.

- `actor_specs` is what the Ray adapter (flows/ray_exec.py) starts: one `ActorSpec` per process of a stage (each
  update rank, each rollout replica, the reward worker), rank/replica order = placement order (rank 0 first), with
  the pool it must land on (a Ray custom resource `pool:<name>` that the pool's nodes offer) and the environment
  `process_env` gives it, over the driver's NCCL/gloo settings (`driver_env`: Ray does not pass the driver's
  environment on). `CUDA_VISIBLE_DEVICES` must be set before CUDA initialises, which the actor does before it
  imports torch. A gpu update rank sees only its own device (local rank 0); a rollout replica sees its block of
  `tensor_parallel` devices; cpu processes see none (`CUDA_VISIBLE_DEVICES=""`) and get `ACCELERATE_USE_CPU=1`.
  Threads per process = the pool's cores // the stage's processes in that pool (at least 1), as `OMP_NUM_THREADS`
  and `FORGEWEAVE_THREADS` (for `torch.set_num_threads`). Stages of one pool take turns within a step (the loop is
  synchronous), so a stage does not divide cores with the stages it shares a pool with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weaver.errors import PlanError
from weaver.plan import Plan


@dataclass(frozen=True)
class ActorSpec:
    """One long-lived worker process of a stage, as the execution layer must start it."""

    stage: str
    index: int
    """Rank (update) or replica number (rollout); 0 for single-process stages."""
    pool: str
    host: str
    devices: tuple[int, ...]
    """GPU indices on `host` this process sees (empty: CPU only)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment to set before torch starts (CUDA_VISIBLE_DEVICES, thread counts, pool and stage names)."""

    @property
    def resources(self) -> dict[str, float]:
        """Ray custom resources that pin the process to a node of its pool (each node offers `pool:<name>`)."""
        return {pool_resource(self.pool): 0.001}


def pool_resource(pool: str) -> str:
    """The Ray custom resource a node of `pool` offers (`ray start --resources '{"pool:gen": 1}'`)."""
    return f"pool:{pool}"


DRIVER_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")


def driver_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables of the driver's environment `environ` that every stage process must see too: NCCL's and gloo's
    settings (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`, `NCCL_IB_DISABLE`, `NCCL_DEBUG`, ...) and torch's NCCL
    switches (`TORCH_NCCL_*`). A Ray worker inherits the environment of its node's raylet, not the driver's: on a
    cluster, a variable set only where `forgeweave run` runs would otherwise never reach the update ranks or the
    engines, whose process groups would then pick their own (often the wrong) network interface.

    >>> driver_env({"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5", "HOME": "/root", "NCCL": "x"})
    {'NCCL_SOCKET_IFNAME': 'ens5', 'GLOO_SOCKET_IFNAME': 'ens5'}
    """
    return {k: v for k, v in environ.items() if k.startswith(DRIVER_ENV_PREFIXES)}


def actor_specs(plan: Plan, stage: str, pool_cores: dict[str, int], per_process_devices: int = 1) -> list[ActorSpec]:
    """The processes of `stage`: one per planned process, rank/replica order = placement order (rank 0 first).

    `pool_cores` gives each pool's cores (threads per process = cores // the stage's processes on that pool);
    `per_process_devices` is how many of a gpu placement's devices each process takes (tensor parallel size)."""
    a = plan.for_stage(stage)
    if a.kind == "gpu" and any(len(p.devices) % per_process_devices for p in a.placements):
        raise PlanError(f"stage {stage!r}: {per_process_devices} devices per process do not divide its devices")
    specs: list[ActorSpec] = []
    for p in a.placements:
        count = len(p.devices) // per_process_devices if a.kind == "gpu" else p.processes
        threads = str(max(1, pool_cores.get(p.pool, 1) // max(1, count)))
        for i in range(count):
            devices = p.devices[i * per_process_devices : (i + 1) * per_process_devices] if a.kind == "gpu" else ()
            env = process_env(stage, p.pool, tuple(devices), int(threads), gpu=a.kind == "gpu")
            if a.kind == "gpu":  # stages sharing these GPUs: a vLLM engine sleeps during a colocated update
                env["FORGEWEAVE_COLOCATED"] = ",".join(a.colocated_with)
            specs.append(ActorSpec(stage, len(specs), p.pool, p.host, tuple(devices), env))
    return specs


def process_env(stage: str, pool: str, devices: tuple[int, ...], threads: int, gpu: bool) -> dict[str, str]:
    """The environment of one stage process (see the module docstring).

    >>> process_env("reward", "cpu", (), 2, gpu=False)["CUDA_VISIBLE_DEVICES"], process_env("update", "g", (3,), 4, True)["CUDA_VISIBLE_DEVICES"]
    ('', '3')
    """
    env = {"OMP_NUM_THREADS": str(max(1, threads)), "FORGEWEAVE_THREADS": str(max(1, threads)),
           "FORGEWEAVE_STAGE": stage, "FORGEWEAVE_POOL": pool, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}  # fmt: skip
    if not gpu:
        env["ACCELERATE_USE_CPU"] = "1"
    return env
