"""Resource pools: named groups of CPU cores or GPUs on one host that stages are planned onto.

A pool is either autodetected from `discover()` (one machine: a `cpu` pool with all cores and RAM, plus a `gpu`
pool with all GPUs when there are any) or declared in the run config under `pools:` and read by
`pools_from_dicts`. Standard library only: no IO here, the caller reads the file.

Rules checked (by `pools_from_dicts` field by field, and by `validate_pools` for pools built in code):
- names are unique; kind is `cpu` or `gpu`;
- a gpu pool lists its device indices (unique, >= 0) and its memory per device (`memory_gib` > 0);
- a cpu pool lists no devices; its `memory_gib` is total RAM, 0 meaning "not declared" (memory is then not checked);
- one GPU (host, index) belongs to at most one pool.
A pool is one machine's share: a pool never spans hosts. Several pools may sit on one host (e.g. GPUs 0-5 for
training and 6-7 for generation). In Ray execution a pool's nodes offer the custom resource `pool:<name>`, which is
how each stage's actors land on its pool (weaver.apply.actor_specs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from weaver.discover import Resources
from weaver.errors import PlanError

PoolKind = Literal["cpu", "gpu"]
GPU_RESERVABLE = ("teacher",)  # stages placed one process beside another (weaver.plan rule 8)
POOL_KEYS = ("name", "kind", "devices", "host", "work_pool", "cpu_cores", "memory_gib", "stages")


@dataclass(frozen=True)
class Pool:
    name: str
    """Unique pool name; used in plans, Prefect tags (`pool:<name>`) and concurrency limits."""
    kind: PoolKind
    """`cpu` (cores + RAM) or `gpu` (a list of devices)."""
    devices: tuple[int, ...] = ()
    """GPU indices on `host` (as CUDA numbers them there); empty for cpu pools."""
    host: str = "localhost"
    """Machine the pool lives on."""
    work_pool: str = ""
    """Not used since Ray execution replaced the per-stage Prefect deployments; accepted so older configs load."""
    cpu_cores: int = 1
    """Cores on `host` this pool's processes may use."""
    memory_gib: float = 0.0
    """cpu: total RAM in GiB (0 = not declared, unchecked); gpu: memory PER device in GiB."""
    stages: tuple[str, ...] = ()
    """The stages this pool is reserved for (empty = any stage). cpu pools: any stages, e.g. a `gen` pool for rollout
    and a `train` pool for update, each a set of Ray nodes in Ray execution. gpu pools: only `teacher` (GPUs of its
    own for the distillation teacher); the other GPU stages share the unreserved gpu pools."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = list(self.devices)
        d["stages"] = list(self.stages)
        return d


def autodetect_pools(res: Resources) -> list[Pool]:
    """One machine: a `cpu` pool, plus a `gpu` pool with every GPU (memory = the smallest GPU's, to stay safe)."""
    pools = [Pool("cpu", "cpu", host=res.host, cpu_cores=res.cpu_cores, memory_gib=res.memory_gib)]
    if res.gpus:
        devices = tuple(g.index for g in res.gpus)
        memory = min(g.memory_gib for g in res.gpus)
        pools.append(Pool("gpu", "gpu", devices, host=res.host, cpu_cores=res.cpu_cores, memory_gib=memory))
    return pools


def pools_from_dicts(items: list[dict[str, Any]], source: str = "") -> list[Pool]:
    """Parse declared pools (e.g. the `pools:` list of a run config); errors name `source`, the item and the field."""
    prefix = f"{source}: " if source else ""
    if not isinstance(items, list) or not items:
        raise PlanError(f"{prefix}pools: expected a non-empty list of pools (each with name and kind)")
    pools = [_pool_from_dict(item, f"{prefix}pools[{i}]") for i, item in enumerate(items)]
    validate_pools(pools, prefix)
    return pools


def validate_pools(pools: list[Pool], prefix: str = "") -> None:
    """Checks that involve one pool's consistency or several pools together; raises PlanError on the first problem."""
    if not pools:
        raise PlanError(f"{prefix}no pools: declare some, or use autodetect_pools(discover())")
    seen: dict[str, int] = {}
    owner: dict[tuple[str, int], str] = {}
    for i, p in enumerate(pools):
        where = f"{prefix}pools[{i}]"
        if p.name in seen:
            raise PlanError(f"{where}.name: duplicate pool name {p.name!r} (also pools[{seen[p.name]}])")
        seen[p.name] = i
        _check_kind_fields(p, where)
        for d in p.devices:
            if (p.host, d) in owner:
                raise PlanError(f"{where}.devices: GPU {d} on {p.host} is already in pool {owner[(p.host, d)]!r}")
            owner[(p.host, d)] = p.name


def _check_kind_fields(p: Pool, where: str) -> None:
    if p.kind not in ("cpu", "gpu"):
        raise PlanError(f"{where}.kind: {p.kind!r} is not a pool kind; use 'cpu' or 'gpu'")
    if p.kind == "gpu" and not p.devices:
        raise PlanError(f"{where}.devices: gpu pool {p.name!r} lists no devices; give its GPU indices, e.g. [0, 1]")
    if p.kind == "gpu" and p.memory_gib <= 0:
        raise PlanError(f"{where}.memory_gib: gpu pool {p.name!r} needs the memory per GPU in GiB, e.g. 80")
    if p.kind == "cpu" and p.devices:
        raise PlanError(f"{where}.devices: cpu pool {p.name!r} takes no devices; use kind: gpu for GPUs")
    if len(set(p.devices)) != len(p.devices):
        raise PlanError(f"{where}.devices: pool {p.name!r} lists a device twice: {list(p.devices)}")
    if p.kind == "gpu" and set(p.stages) - set(GPU_RESERVABLE):
        raise PlanError(
            f"{where}.stages: a gpu pool is reserved only for {', '.join(GPU_RESERVABLE)}; the other GPU "
            "stages share the unreserved gpu pools (cpu pools may be reserved for any stage)"
        )


def _pool_from_dict(item: Any, where: str) -> Pool:
    if not isinstance(item, dict):
        raise PlanError(f"{where}: expected a mapping with name and kind, got {type(item).__name__}")
    unknown = sorted(set(item) - set(POOL_KEYS))
    if unknown:
        raise PlanError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(POOL_KEYS)})")
    for key in ("name", "kind"):
        if key not in item:
            raise PlanError(f"{where}.{key}: missing; every pool needs a name and a kind (cpu or gpu)")
    return Pool(
        name=_text(item["name"], f"{where}.name", empty_ok=False),
        kind=_text(item["kind"], f"{where}.kind", empty_ok=False),  # type: ignore[arg-type]  # checked later
        devices=_devices(item.get("devices", []), f"{where}.devices"),
        host=_text(item.get("host", "localhost"), f"{where}.host", empty_ok=False),
        work_pool=_text(item.get("work_pool", ""), f"{where}.work_pool", empty_ok=True),
        cpu_cores=_positive_int(item.get("cpu_cores", 1), f"{where}.cpu_cores"),
        memory_gib=_gib(item.get("memory_gib", 0.0), f"{where}.memory_gib"),
        stages=_names(item.get("stages", []), f"{where}.stages"),
    )


def _text(v: Any, where: str, *, empty_ok: bool) -> str:
    if not isinstance(v, str) or (not empty_ok and not v.strip()):
        raise PlanError(f"{where}: expected a {'' if empty_ok else 'non-empty '}string, got {v!r}")
    return v


def _devices(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or not all(_is_int(d) and d >= 0 for d in v):
        raise PlanError(f"{where}: expected a list of GPU indices like [0, 1, 2, 3], got {v!r}")
    return tuple(v)


def _names(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x.strip() for x in v):
        raise PlanError(f"{where}: expected a list of stage names like [rollout, reward], got {v!r}")
    return tuple(v)


def _positive_int(v: Any, where: str) -> int:
    if not _is_int(v) or v < 1:
        raise PlanError(f"{where}: expected a whole number >= 1, got {v!r}")
    return int(v)


def _gib(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise PlanError(f"{where}: expected a number of GiB >= 0, got {v!r}")
    return float(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
