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
- What each process asks Ray for, so that two runs on one cluster never share a GPU: `with_ray_cpus` gives every
  process its share of its pool's CPUs (`ray_pool_cpus`: the pool's cores, at most what a node offering it has, split
  between the run's pools on that node; stages of a pool take turns, so the share is the pool's CPUs / all the run's
  processes there), and `placement_bundles` groups the processes into the run's placement-group bundles: one per
  gpu pool holding every GPU the run uses there (so processes the plan colocates on a GPU are on one node, sharing
  what that bundle reserved), one per cpu process. The execution layer reserves the bundles in one placement group
  and maps the plan's devices of a pool, in order, onto the GPU ids Ray reserved there (`with_gpu_ids`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

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
    cpus: float = 0.0
    """Ray CPUs the process asks for (`with_ray_cpus`); its GPUs are its placement bundle's (`placement_bundles`)."""

    @property
    def resources(self) -> dict[str, float]:
        """Ray custom resources that pin the process to a node of its pool (each node offers `pool:<name>`)."""
        return {pool_resource(self.pool): POOL_SLIVER}


@dataclass(frozen=True)
class Bundle:
    """One bundle of a run's Ray placement group: what it reserves on one node of `pool` for `processes` processes."""

    pool: str
    devices: tuple[int, ...]
    """The plan's GPU indices in `pool` it reserves (as many Ray GPUs); empty: CPUs only."""
    cpus: float
    processes: int

    @property
    def resources(self) -> dict[str, float]:
        """The bundle as Ray takes it (no zero entries: Ray refuses them)."""
        res = {pool_resource(self.pool): POOL_SLIVER * self.processes}
        if self.cpus > 0:
            res["CPU"] = self.cpus
        if self.devices:
            res["GPU"] = float(len(self.devices))
        return res


POOL_SLIVER = 0.001  # of `pool:<name>` per process: pins it to the pool's nodes, nothing more


def pool_resource(pool: str) -> str:
    """The Ray custom resource a node of `pool` offers (`ray start --resources '{"pool:gen": 1}'`)."""
    return f"pool:{pool}"


DRIVER_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "FORGEWEAVE_WEIGHT_SECRET")


def driver_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables of the driver's environment `environ` that every stage process must see too: NCCL's and gloo's
    settings (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`, `NCCL_IB_DISABLE`, `NCCL_DEBUG`, ...), torch's NCCL
    switches (`TORCH_NCCL_*`) and the run's weight-group secret (`FORGEWEAVE_WEIGHT_SECRET`, forge/weight_group.py). A Ray worker inherits the environment of its node's raylet, not the driver's: on a
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


def ray_pool_cpus(pool_cores: dict[str, int], nodes: list[dict[str, float]]) -> dict[str, float]:
    """The Ray CPUs a run may ask for in each of its pools: the pool's declared cores, at most the CPUs of the largest
    node offering it (`pool:<name>` among the node's total resources) divided by the run's pools that node offers —
    so the run's asks fit the cluster even where pools declare more cores than its nodes have (a test cluster).

    >>> ray_pool_cpus({"gen": 1, "train": 2}, [{"CPU": 2.0, "pool:gen": 1000.0, "pool:train": 1000.0}])
    {'gen': 1.0, 'train': 1.0}
    >>> ray_pool_cpus({"gen": 1, "train": 2}, [{"CPU": 1.0, "pool:gen": 1.0}, {"CPU": 2.0, "pool:train": 1.0}])
    {'gen': 1.0, 'train': 2.0}
    """
    out: dict[str, float] = {}
    for pool, cores in pool_cores.items():
        shares = [n.get("CPU", 0.0) / sum(pool_resource(p) in n for p in pool_cores)
                  for n in nodes if pool_resource(pool) in n]  # fmt: skip
        out[pool] = min(float(cores), max(shares, default=0.0))
    return out


def with_ray_cpus(specs: list[ActorSpec], pool_cpus: dict[str, float]) -> list[ActorSpec]:
    """`specs` (every process of a run) with `cpus` set: each pool's Ray CPUs split evenly between the run's
    processes in it (the stages of a pool take turns, so a process's threads are not what it holds alone).

    >>> [s.cpus for s in with_ray_cpus([ActorSpec(st, 0, "cpu", "h", ()) for st in ("a", "b", "c")], {"cpu": 2.0})]
    [0.6666, 0.6666, 0.6666]
    """
    count: dict[str, int] = {}
    for s in specs:
        count[s.pool] = count.get(s.pool, 0) + 1
    # Ray counts resources in 1e-4 units: round down, so that the shares never add up to more than the pool's
    return [replace(s, cpus=math.floor(pool_cpus.get(s.pool, 0.0) / count[s.pool] * 1e4) / 1e4) for s in specs]


def placement_bundles(specs: list[ActorSpec]) -> tuple[list[Bundle], list[int]]:
    """The run's placement-group bundles and each process's bundle index (in `specs` order): one bundle per pool for
    the processes with GPUs (every GPU the run uses there, the plan's indices in order), one per CPU-only process.

    >>> gpu = [ActorSpec("update", 0, "g", "h", (0,), cpus=1.0), ActorSpec("rollout", 0, "g", "h", (0, 1), cpus=1.0)]
    >>> bundles, index = placement_bundles([*gpu, ActorSpec("reward", 0, "c", "h", (), cpus=0.5)])
    >>> [(b.pool, b.devices, b.cpus, b.processes) for b in bundles], index
    ([('g', (0, 1), 2.0, 2), ('c', (), 0.5, 1)], [0, 0, 1])
    """
    bundles: list[Bundle] = []
    index: list[int] = []
    gpu_bundle: dict[str, int] = {}
    for s in specs:
        if s.devices and s.pool in gpu_bundle:
            i = gpu_bundle[s.pool]
            b = bundles[i]
            devices = tuple(sorted(set(b.devices) | set(s.devices)))
            bundles[i] = Bundle(b.pool, devices, round(b.cpus + s.cpus, 4), b.processes + 1)
        else:
            i = len(bundles)
            bundles.append(Bundle(s.pool, tuple(sorted(s.devices)), s.cpus, 1))
            if s.devices:
                gpu_bundle[s.pool] = i
        index.append(i)
    return bundles, index


@dataclass(frozen=True)
class WeightRoutes:
    """How weights go from the update ranks to the rollout replicas (`weight_transport`)."""

    transport: str
    """'group' (one broadcast group that update rank 0 hosts) or 'ipc' (CUDA IPC handles; shared memory on the CPU)."""
    groups: dict[int, tuple[int, ...]]
    """Update rank -> the rollout replicas in the weight group it hosts (ranks that feed none are left out)."""


def weight_transport(setting: str, senders: list[ActorSpec], receivers: list[ActorSpec]) -> WeightRoutes:
    """How weights go from the update ranks (`senders`, rank order) to the rollout replicas (`receivers`), and which
    replicas each rank feeds. `setting` (rollout.weight_transport): `group` = one broadcast group hosted by update
    rank 0 with every replica in it; `ipc` = one group per update rank that shares its GPU with replicas (its pool,
    host and single device), each replica in the group of the rank on its GPU (every rank holds the full weights at
    a publish: DDP its replica, FSDP gathers each parameter on every rank); `auto` = ipc when every replica shares
    an update rank's GPU, else group. On the CPU (no process has a device) auto is group, and ipc (shared memory,
    every process on one host: how the tests run it) puts replica i with rank i % ranks.
    PlanError (one line): some replicas on update ranks' GPUs and others not (any setting); ipc asked for with a
    replica on no update rank's GPU; group asked for with a replica on rank 0's GPU (NCCL refuses two ranks of one
    group on one GPU); a colocated tensor-parallel engine (its workers span several GPUs) under
    auto or ipc — not built.

    >>> up = [ActorSpec("update", r, "g", "h", (r,)) for r in range(2)]
    >>> gen = [ActorSpec("rollout", i, "g", "h", (i,)) for i in range(2)]
    >>> weight_transport("auto", up, gen)
    WeightRoutes(transport='ipc', groups={0: (0,), 1: (1,)})
    >>> weight_transport("auto", up, [replace(g, devices=(g.index + 2,)) for g in gen])
    WeightRoutes(transport='group', groups={0: (0, 1)})
    >>> cpu = [replace(s, devices=()) for s in [*up, *gen]]
    >>> weight_transport("auto", cpu[:2], cpu[2:]).transport, weight_transport("ipc", cpu[:1], cpu[2:]).groups
    ('group', {0: (0, 1)})
    """
    everyone = list(range(len(receivers)))
    gpu = any(s.devices for s in [*senders, *receivers])
    home = [_gpu_home(r, senders) for r in receivers]  # the update rank whose one GPU the replica has, else None
    if gpu:
        _check_colocation(setting, senders, receivers, home)
    if setting == "group" or (setting == "auto" and not (gpu and receivers and None not in home)):
        return WeightRoutes("group", {0: tuple(everyone)})
    if not gpu:
        home = [i % max(1, len(senders)) for i in everyone]
    groups = {r: tuple(i for i in everyone if home[i] == r) for r in range(len(senders))}
    return WeightRoutes("ipc", {r: g for r, g in groups.items() if g})


def _gpu_home(receiver: ActorSpec, senders: list[ActorSpec]) -> int | None:
    """The update rank whose single GPU `receiver` has as its only device (same pool and host), else None."""
    for rank, s in enumerate(senders):
        if len(s.devices) == 1 and (receiver.pool, receiver.host, receiver.devices) == (s.pool, s.host, s.devices):
            return rank
    return None


def _check_colocation(setting: str, senders: list[ActorSpec], receivers: list[ActorSpec],
                      home: list[int | None]) -> None:  # fmt: skip
    """`weight_transport`'s one-line refusals on GPUs (see there)."""
    on = [i for i, h in enumerate(home) if h is not None]
    if on and len(on) < len(receivers):
        raise PlanError(f"rollout.weight_transport: rollout replicas {on} share an update rank's GPU and the others "
                        "do not: plan them all on the update ranks' GPUs or all elsewhere", "rollout")  # fmt: skip
    used = {(s.pool, s.host, d) for s in senders for d in s.devices}
    on_used = [bool({(r.pool, r.host, d) for d in r.devices} & used) for r in receivers]
    spans = [i for i, r in enumerate(receivers) if len(r.devices) > 1 and on_used[i]]
    if spans and setting != "group":
        raise PlanError(f"rollout.weight_transport: rollout replicas {spans} are tensor-parallel engines on the update "
                        "ranks' GPUs: colocated weight sync for engines spanning several GPUs is not built (set "
                        "rollout.tensor_parallel_size=1 or give rollout GPUs of its own)", "rollout")  # fmt: skip
    if setting == "group" and (clash := [i for i, h in enumerate(home) if h == 0]):
        raise PlanError(f"rollout.weight_transport=group: rollout replicas {clash} share update rank 0's GPU, where "
                        "NCCL refuses two ranks of one group: set it to auto or ipc", "rollout")  # fmt: skip
    if setting == "ipc" and len(on) < len(receivers):
        raise PlanError("rollout.weight_transport=ipc needs every rollout replica on the GPU of an update rank (same "
                        "pool, host and device): set it to group or auto", "rollout")  # fmt: skip


def with_gpu_ids(spec: ActorSpec, ids: dict[int, str]) -> ActorSpec:
    """`spec` seeing the GPUs Ray reserved for its devices (`ids`: the plan's index in its pool -> Ray's GPU id on
    the node): its CUDA_VISIBLE_DEVICES lists them in the plan's order.

    >>> with_gpu_ids(ActorSpec("rollout", 0, "g", "h", (2, 3), {"CUDA_VISIBLE_DEVICES": "2,3"}), {2: "6", 3: "7"}).env
    {'CUDA_VISIBLE_DEVICES': '6,7'}
    """
    if not spec.devices:
        return spec
    return replace(spec, env={**spec.env, "CUDA_VISIBLE_DEVICES": ",".join(ids[d] for d in spec.devices)})
