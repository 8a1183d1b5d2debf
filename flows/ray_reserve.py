"""What a Ray-mode run holds on the cluster: one placement group with the GPUs and CPUs its plan gives its processes.

Every process asks Ray for what the plan gives it (`weaver.apply`: its share of its pool's CPUs; the GPUs of its
pool's bundle), through one placement group per run (`reserve`), removed when the run's actors go (`close`):

- a gpu pool's processes share one bundle holding every GPU the run uses there, so the stages the plan colocates on
  a GPU land on one node; a cpu process has a bundle of its own; bundles carry a sliver of `pool:<name>`, so each
  lands on a node of its pool, spread over the pool's nodes (`SPREAD`: rollout replicas on different nodes);
- Ray decides which physical GPUs a bundle holds: a task in each gpu bundle reads them (`reserved_gpu_ids`), and
  the plan's devices of that pool map onto them in order (`weaver.apply.with_gpu_ids`), which each actor gets as
  CUDA_VISIBLE_DEVICES before torch starts. The actors themselves ask for no GPU (Ray would pick their ids within
  the bundle, and cannot give two processes halves of two GPUs, as colocated tensor-parallel engines need). On a
  node the run has to itself, Ray reserves its lowest free ids: the plan's own numbers when the pool lists them.
- a run whose bundles do not fit because other jobs hold the resources waits up to
  `orchestration.reserve_timeout_s` (one line says what it waits for and who holds it), then stops with one line;
  a bundle no node could ever hold (more GPUs than any node of the pool has) stops at once.

Two private Ray instances on one host (two runs without `orchestration.ray_address`) cannot see each other's
reservations: there the run also locks the GPUs it reserved with a file lock per GPU id
(`$TMPDIR/forgeweave-gpus/<id>.lock`, `flock`, released when the driver exits however it ends), waiting for them
as above.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flows.ray_actor import reserved_gpu_ids
from forge.errors import UserError
from forge.loop import say
from weaver.apply import ActorSpec, Bundle, placement_bundles, pool_resource, with_gpu_ids

GPU_PROBE_TIMEOUT_S = 120.0  # reading the reserved GPU ids in a ready placement group
NOTICE_S = 2.0  # a reservation not ready by then prints the one line saying what it waits for
LOCKS = Path(tempfile.gettempdir()) / "forgeweave-gpus"


@dataclass
class Reservation:
    """A run's placement group: its bundles, every process's spec (CUDA_VISIBLE_DEVICES = Ray's GPU ids) and bundle."""

    pg: PlacementGroup
    bundles: list[Bundle]
    specs: list[ActorSpec]
    index: list[int]
    gpu_ids: dict[str, list[str]] = field(default_factory=dict)
    """pool -> the GPU ids Ray reserved there (the plan's devices of the pool, in order, map onto them)."""
    locks: list[IO] = field(default_factory=list)

    def of(self, stage: str) -> list[ActorSpec]:
        return [s for s in self.specs if s.stage == stage]

    def strategy(self, spec: ActorSpec) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy that puts `spec`'s actor in its bundle."""
        i = next(k for k, s in enumerate(self.specs) if (s.stage, s.index) == (spec.stage, spec.index))
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.index[i])

    def close(self) -> None:
        """Give everything back (actors in the group are killed by Ray if still alive)."""
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        for f in self.locks:
            f.close()  # closing the file releases its flock
        self.locks = []


def reserve(specs: list[ActorSpec], name: str, timeout_s: float, lock_host_gpus: bool = False) -> Reservation:
    """Reserve what `specs` (every process of the run) ask for; see the module docstring. Raises UserError (one
    line) when it cannot be had within `timeout_s`, or ever."""
    bundles, index = placement_bundles(specs)
    _check_gpus_offered(bundles)
    pg = placement_group([b.resources for b in bundles], strategy="SPREAD", name=name)
    res = Reservation(pg, bundles, list(specs), index)
    try:
        deadline = time.monotonic() + timeout_s
        _wait(lambda t: bool(ray.wait([pg.ready()], timeout=t)[0]), deadline, bundles, lambda: _holders(pg, bundles))
        res.gpu_ids = _gpu_ids(pg, bundles)
        ids = {b.pool: dict(zip(b.devices, res.gpu_ids[b.pool], strict=True)) for b in bundles if b.devices}
        res.specs = [with_gpu_ids(s, ids.get(s.pool, {})) for s in specs]
        if lock_host_gpus and res.gpu_ids:
            res.locks = _lock(sorted({i for v in res.gpu_ids.values() for i in v}), deadline, bundles)
    except BaseException:
        res.close()
        raise
    return res


def _wait(ready: Callable[[float], bool], deadline: float, bundles: list[Bundle], holders: Callable[[], str]) -> None:
    """Poll `ready(seconds)` until it is true; one line when it is not within NOTICE_S (always allowed: free
    resources take a moment too), a UserError at `deadline`."""
    if ready(NOTICE_S):
        return
    left = deadline - time.monotonic()
    if left > 0:
        say(f"forgeweave: waiting up to {left:.0f} s for {_wanted(bundles)}, held by {holders()}")
        if ready(left):
            return
    raise UserError(
        f"Ray could not reserve {_wanted(bundles)} for this run: {holders()} holds them; start it again when that "
        "run has ended, or raise orchestration.reserve_timeout_s to wait longer"
    )


def _wanted(bundles: list[Bundle]) -> str:
    """'GPUs 0,1 and 1.5 CPUs of pool 'gpu', 1 CPU of pool 'cpu''."""
    pools: dict[str, tuple[list[int], float]] = {}
    for b in bundles:
        devices, cpus = pools.get(b.pool, ([], 0.0))
        pools[b.pool] = (devices + list(b.devices), cpus + b.cpus)
    parts = []
    for pool, (devices, cpus) in pools.items():
        what = [f"GPU{'s' if len(devices) > 1 else ''} {','.join(map(str, devices))}"] if devices else []
        what += [f"{cpus:g} CPU{'s' if cpus != 1 else ''}"] if cpus else []
        parts.append(f"{' and '.join(what) or 'a slot'} of pool {pool!r}")
    return ", ".join(parts)


def _holders(pg: PlacementGroup, bundles: list[Bundle]) -> str:
    """Who holds what this run waits for: the other placement groups on its pools (`forgeweave:<run>` for a run)."""
    pools = {pool_resource(b.pool) for b in bundles}
    names = set()
    for pg_id, info in placement_group_table().items():
        if pg_id == pg.id.hex() or info.get("state") != "CREATED":
            continue
        if any(pools & set(b) for b in info.get("bundles", {}).values()):
            names.add(info.get("name") or pg_id[:8])
    return ", ".join(sorted(names)) or "other Ray jobs (no placement group of a run)"


def _check_gpus_offered(bundles: list[Bundle]) -> None:
    """A gpu bundle needs one node of its pool with that many GPUs; none having them is a one-line error now."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for b in bundles:
        if not b.devices:
            continue
        most = max((n.get("GPU", 0.0) for n in nodes if pool_resource(b.pool) in n), default=0.0)
        if most < len(b.devices):
            raise UserError(
                f"pool {b.pool!r}: the plan gives this run {len(b.devices)} GPUs on one node, but its Ray nodes have "
                f"at most {most:g}: start them with `ray start ... --num-gpus N`, or declare the pool's devices as "
                "the nodes have them"
            )


def _gpu_ids(pg: PlacementGroup, bundles: list[Bundle]) -> dict[str, list[str]]:
    """pool -> the GPU ids Ray reserved in its bundle, read by a task that asks for all of them."""
    calls = {
        b.pool: reserved_gpu_ids.options(
            num_gpus=len(b.devices),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i, b in enumerate(bundles)
        if b.devices
    }
    try:  # the group is ready, so the task starts at once; bounded all the same (a hang would report nothing)
        ids = dict(zip(calls, ray.get(list(calls.values()), timeout=GPU_PROBE_TIMEOUT_S), strict=True))
    except GetTimeoutError:
        raise UserError(
            f"Ray did not run the GPU-id probe in the run's placement group within {GPU_PROBE_TIMEOUT_S:.0f} s: "
            "check the GPU nodes' raylets (`ray status`) and start the run again"
        ) from None
    return {pool: sorted(found, key=_id_order) for pool, found in ids.items()}


def _id_order(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), "") if gpu_id.isdigit() else (1 << 30, gpu_id)


def _lock(ids: list[str], deadline: float, bundles: list[Bundle]) -> list[IO]:
    """Exclusive file locks on these GPU ids of this host (see the module docstring), waiting until `deadline`."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    files = [open(LOCKS / f"{i.replace('/', '_')}.lock", "a") for i in ids]  # noqa: SIM115 (held for the run)

    def ready(seconds: float) -> bool:  # all of them or none: two runs never hold a part each
        end = time.monotonic() + seconds
        while True:
            held = []
            for f in files:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    break
                held.append(f)
            if len(held) == len(files):
                return True
            for f in held:
                fcntl.flock(f, fcntl.LOCK_UN)
            if time.monotonic() >= end:
                return False
            time.sleep(0.2)

    try:
        _wait(ready, deadline, bundles, lambda: f"another run's private Ray on this host (a GPU lock in {LOCKS})")
    except BaseException:
        for f in files:
            f.close()
        raise
    return files
