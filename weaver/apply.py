"""Apply a plan: what each stage's processes get (environment, Accelerate launch arguments, Prefect tags, concurrency
limits, work pools). Small pure functions over a `Plan` returning plain values; the caller (flows/) sets them.

- `stage_env` is meant for the environment of the process that runs a stage (a subprocess, `accelerate launch`, a
  vLLM server, a Prefect worker's job): `CUDA_VISIBLE_DEVICES` must be set before CUDA initialises, so setting it
  in an already running process that has touched torch.cuda does nothing.
  GPU stages see only their devices; cpu stages see none (`CUDA_VISIBLE_DEVICES=""`) and get
  `ACCELERATE_USE_CPU=1`. Threads per process = the host's cores // the stage's processes on that host (at least
  1), as `OMP_NUM_THREADS` and `FORGEWEAVE_THREADS` (for `torch.set_num_threads`). Stages of one pool run one at a
  time (see `concurrency_limits`), so a stage does not divide cores with the stages it shares a pool with.
- `accelerate_launch_args` follows shared/reference/environment.md: `accelerate launch --cpu --num_processes 2`
  silently runs ONE process, so several CPU processes are launched with `--multi_gpu` plus
  `ACCELERATE_USE_CPU=1` (from `stage_env`). Devices are chosen by `CUDA_VISIBLE_DEVICES`, not `--gpu_ids`.
  Multi-node: rank r runs on `plan.for_stage("update").placements[r].host` with that placement's environment;
  the same arguments with `--machine_rank r` (or the `{machine_rank}` placeholder, filled by the caller).
- `actor_specs` is what the Ray adapter (flows/ray_exec.py) starts: one `ActorSpec` per process of a stage (each
  update rank, each rollout replica, the reward worker), with the pool it must land on (a Ray custom resource
  `pool:<name>` that the pool's nodes carry), its devices and its environment from `stage_env`. A gpu update rank
  sees only its own device (local rank 0); a rollout replica sees its block of `tensor_parallel` devices.
- Prefect: every stage task carries `pool:<pool>` for each pool it uses and `stage:<stage>`. The limit on
  `pool:<name>` is the number of groups of that pool's stages that share no device: 1 for a cpu pool or a
  colocated gpu pool, 2 for a gpu pool split between update and rollout. Tag only the task that does the work,
  not also a wrapper task that waits on it: with a limit of 1 the two would wait on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weaver.errors import PlanError
from weaver.plan import ANCHOR, Assignment, Placement, Plan

MAIN_PROCESS_PORT = 29500


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
            env = {"OMP_NUM_THREADS": threads, "FORGEWEAVE_THREADS": threads, "FORGEWEAVE_STAGE": stage,
                   "FORGEWEAVE_POOL": p.pool, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}  # fmt: skip
            if a.kind == "cpu":
                env["ACCELERATE_USE_CPU"] = "1"
            specs.append(ActorSpec(stage, len(specs), p.pool, p.host, tuple(devices), env))
    return specs


def stage_env(plan: Plan, stage: str, total_cpu_cores: int, *, host: str | None = None) -> dict[str, str]:
    """Environment for `stage`'s processes on `host` (default: its first placement, where rank 0 runs)."""
    a = plan.for_stage(stage)
    p = _placement(a, host)
    threads = str(max(1, total_cpu_cores // p.processes))
    env = {
        "OMP_NUM_THREADS": threads,
        "FORGEWEAVE_THREADS": threads,
        "FORGEWEAVE_STAGE": stage,
        "FORGEWEAVE_POOL": p.pool,
    }
    if a.kind == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in p.devices)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["ACCELERATE_USE_CPU"] = "1"
    return env


def accelerate_launch_args(
    plan: Plan, *, machine_rank: int | None = None, main_process_port: int = MAIN_PROCESS_PORT
) -> list[str]:
    """`accelerate launch` arguments (before the script) for the update stage."""
    a = plan.for_stage(ANCHOR)
    n = str(a.processes)
    if a.kind == "cpu":
        if a.processes == 1:
            return ["--cpu", "--num_processes", "1", "--num_machines", "1"]
        return ["--multi_gpu", "--num_processes", n, "--num_machines", "1"]  # with ACCELERATE_USE_CPU=1
    args = (["--multi_gpu"] if a.processes > 1 else []) + ["--num_processes", n]
    args += ["--num_machines", str(len(a.placements))]
    if len(a.placements) > 1:
        rank = "{machine_rank}" if machine_rank is None else str(machine_rank)
        args += ["--machine_rank", rank, "--main_process_ip", a.host, "--main_process_port", str(main_process_port)]
    return args


def prefect_tags(plan: Plan, stage: str) -> list[str]:
    """E.g. ["pool:gpu", "stage:update"]; one pool tag per pool the stage uses."""
    return [f"pool:{p}" for p in dict.fromkeys(plan.for_stage(stage).pools)] + [f"stage:{stage}"]


def concurrency_limits(plan: Plan) -> dict[str, int]:
    """Tag -> how many stage tasks may run at once: per pool, the number of stage groups sharing no device."""
    footprints: dict[str, list[set[int]]] = {}
    for a in plan.assignments:
        for p in a.placements:
            footprints.setdefault(p.pool, []).append(set(p.devices) if a.kind == "gpu" else {-1})
    return {f"pool:{pool}": _disjoint_groups(sets) for pool, sets in footprints.items()}


def work_pool_for(plan: Plan, stage: str) -> str:
    """Prefect work pool that runs the stage's deployment ("" = in-process); for update across hosts, rank 0's."""
    return plan.for_stage(stage).work_pool


def work_pools(plan: Plan) -> list[str]:
    """Every non-empty work pool the plan uses, in order of first use (the ones to create and start workers on)."""
    return list(dict.fromkeys(p.work_pool for a in plan.assignments for p in a.placements if p.work_pool))


def _placement(a: Assignment, host: str | None) -> Placement:
    if host is None:
        return a.placements[0]
    for p in a.placements:
        if p.host == host:
            return p
    raise PlanError(f"stage {a.stage!r} has no processes on host {host!r}; it runs on {', '.join(a.hosts)}")


def _disjoint_groups(sets: list[set[int]]) -> int:
    """Connected components of sets linked by overlap: {0,1},{1},{4} -> 2."""
    groups: list[set[int]] = []
    for s in sets:
        touching = [g for g in groups if g & s]
        merged = set(s).union(*touching)
        groups = [g for g in groups if not g & s] + [merged]
    return len(groups)
