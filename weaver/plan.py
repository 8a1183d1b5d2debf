"""The planner: which stage runs where, with how many processes, sharing GPUs or not, and why.

`plan(stages, pools)` is pure and deterministic (no torch, Prefect or IO; the same inputs give the same `Plan`);
`weaver.apply` turns a plan into environment variables, launch arguments and Prefect settings.

Rules, in the order `plan` applies them:
1. GPU devices are considered in pool declaration order, then in each pool's device order.
2. `update` is ONE distributed launch (Accelerate/torchrun), which starts the same number of processes on every
   machine: it may span several gpu pools, at most one pool per host, with an equal device count in each. Among the
   arrangements that fit its memory it takes the most devices (up to `max_devices`); ties go to fewer hosts.
   Rank 0 is the first device of the first pool used. Every other gpu stage (`rollout`, ...) is a set of
   independent replicas, one per device, on any devices that fit it.
3. Colocation (the gpu stages sharing devices) when the sum of their per-device memory fits in one GPU, except
   when every gpu stage asks for a fixed count (`max_devices` > 0) and there are devices enough to give each its
   own: then they are kept apart, which avoids swapping weights in and out of one GPU. Colocated stages take
   the same devices, others starting on update's.
4. Split otherwise: the other gpu stages first take their MINIMUM from the smallest GPUs that fit them, last
   devices first (so update keeps device 0 of the first pool); update then takes what rule 2 allows of the rest;
   devices still free go to the other stages up to their maximum, in stage order. Devices nobody can use stay
   idle (e.g. to keep update's count equal per host).
5. `cpu` stages go to the first cpu pool with enough cores (`min_devices` counts processes there) and RAM; they
   take `max_devices` processes (0 = one per core). Pools reserved for a stage (`stages: [...]`) come first for
   it and are never used by other stages.
6. `any` stages go to the GPUs that still have room for them after rules 2-4 (memory is tracked per device),
   else to a cpu pool, and the reason says which.
7. A stage with `runs_in` (evaluate samples with the rollout engine) takes the first `max_devices` (0 = all)
   devices or processes of that stage and adds no memory.
8. A stage placed `beside` another (the distillation teacher beside update, where the reference model lives) is one
   process: in a cpu pool reserved for it (`stages: [teacher]`) when one is declared; else, on a gpu cluster, on
   the first GPU that holds it in a gpu pool reserved for it (rules 2-4 and 6 never use such a pool); else on the
   other stage's first GPU when that GPU has room left for it (memory tracked per device, after rules 2-4), else
   on the GPU with the most room left; else the other stage takes fewer GPUs (one at a time, down to its minimum)
   until one has room; on CPU in the other stage's pool (a pool reserved for that stage takes it too) when the
   pool's RAM, if declared, holds both, else as rule 5.
An impossible plan raises `PlanError` with one line naming the stage, what it needs and what the pools have.

Memory estimates (`stage_needs`): where the model's shape and the run's tokens are known, `weaver.memory`'s
per-device terms (the caller passes `update_gib_for` and `rollout_gib`). Otherwise, per parameter: update holds fp32 weights + grads + AdamW moments = 16 bytes/param, plus a
reference model's weights when the KL penalty needs one, x1.25 for activations, +1 GiB runtime; each DDP process
holds the full state, each FSDP process 1/N of it (the reference is sharded too). Rollout/evaluate
hold weights in the rollout's dtype (default 2 bytes/param bf16 on GPU, 4 fp32 on CPU) plus an equal KV-cache
margin, +1 GiB; a vLLM engine on a GPU takes its configured fraction of the GPU, whatever the model needs. Prep and
reward are small CPU stages; evaluate runs in rollout (rule 7). A distillation teacher (`teacher_params` > 0) holds
its weights (`teacher_bytes_per_param` each) +1 GiB, beside update (rule 8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from weaver.errors import PlanError
from weaver.pools import Pool, validate_pools

StageKind = Literal["cpu", "gpu", "any"]
ANCHOR = "update"
GIB = 2**30
UPDATE_BYTES_PER_PARAM = 16  # fp32 weights 4 + grads 4 + AdamW exp_avg 4 + exp_avg_sq 4
ACTIVATION_MARGIN = 1.25
RUNTIME_GIB = 1.0  # CUDA context, allocator slack, interpreter
SMALL_STAGE_GIB = 0.5


@dataclass(frozen=True)
class StageNeed:
    name: str
    """prep | rollout | reward | update | evaluate (any name works; `update` gets rule 2)."""
    kind: StageKind
    """gpu, cpu, or any (GPU when one has room, else CPU)."""
    min_devices: int = 1
    """Fewest devices (gpu) or processes (cpu) the stage can run with."""
    max_devices: int = 1
    """Most devices/processes it should get; 0 = as many as available."""
    memory_gib: float = 0.0
    """Per device (gpu) or total (cpu), in GiB."""
    runs_in: str = ""
    """Another stage whose processes run this one (evaluate samples with the rollout engine): it goes on that
    stage's devices/pool and adds no memory; `kind` and `memory_gib` are then not used."""
    beside: str = ""
    """Another stage this one goes with by default (rule 8: the teacher beside update), one process adding its
    `memory_gib` there; a cpu pool reserved for this stage takes it instead."""


def stage_needs(
    model_params: int,
    *,
    rollout_replicas: int = 1,
    update_processes: int = 0,
    gpu: bool,
    rollout_tp: int = 1,
    update_sharded: bool = False,
    reference_bytes_per_param: float = 0.0,
    rollout_bytes_per_param: float = 0.0,
    engine_fraction: float = 0.0,
    gpu_memory_gib: float = 0.0,
    teacher_params: int = 0,
    teacher_bytes_per_param: float = 4.0,
    update_gib_for: Callable[[int], float] | None = None,
    rollout_gib: float = 0.0,
) -> list[StageNeed]:
    """The pipeline stages for a model of `model_params` parameters; 0 replicas/processes = as many as fit
    (on CPU: one, since more processes give no speed-up there). On GPUs each rollout replica is a vLLM engine
    spanning `rollout_tp` devices (tensor parallel): the stage takes replicas x tp devices, each holding 1/tp.

    `update_sharded` (FSDP full shard): each update process holds 1/N of the 16 bytes/param, N = update_processes,
    or with 0 the fewest GPUs of `gpu_memory_gib` whose shards fit (the plan may then give it more). A reference
    model (the KL penalty's) adds `reference_bytes_per_param` (its dtype's size; 0 = none) to it. Rollout holds
    `rollout_bytes_per_param` (0 = 2 on GPU, 4 on CPU) x2 for a KV-cache margin; an engine that reserves a
    fraction of its GPU (`engine_fraction` of `gpu_memory_gib`, vLLM's gpu_memory_utilization) takes that.
    `teacher_params` > 0 adds a sixth stage, `teacher` (on-policy distillation): one process of update's kind
    holding `teacher_bytes_per_param` per parameter +1 GiB, placed beside update (rule 8).

    Where the model's shape and the run's token shapes are known (`weaver.memory`), `update_gib_for(shards)` gives
    the update's GiB per process over that many FSDP shards (it replaces the per-parameter estimate, and sizes the
    automatic shard count), and `rollout_gib` a rollout device's GiB (weights, KV cache, one sync bucket)."""
    if model_params <= 0 or rollout_replicas < 0 or update_processes < 0 or rollout_tp < 1:
        raise PlanError(
            f"stage_needs: model_params must be > 0 and counts >= 0, got {model_params}, "
            f"rollout_replicas={rollout_replicas}, update_processes={update_processes}, rollout_tp={rollout_tp}"
        )
    ref = reference_bytes_per_param
    per_shards = update_gib_for or (lambda n: update_memory_gib(model_params, n, ref))
    shards = (update_processes or _fewest_shards(per_shards, gpu_memory_gib)) if update_sharded and gpu else 1
    update_gib = per_shards(shards)
    weight_bytes = rollout_bytes_per_param or (2 if gpu else 4)
    generate_gib = 2 * model_params * weight_bytes / GIB + RUNTIME_GIB  # weights + equal KV-cache margin
    kind: StageKind = "gpu" if gpu else "cpu"
    tp = rollout_tp if gpu else 1
    rollout_gib = rollout_gib or 2 * model_params * weight_bytes / GIB / tp + RUNTIME_GIB
    if gpu and engine_fraction > 0 and gpu_memory_gib > 0:
        rollout_gib = generate_gib = max(rollout_gib, engine_fraction * gpu_memory_gib)
    update_range = (shards, shards if update_processes else 0) if shards > 1 else _count_range(update_processes, gpu)
    needs = [
        StageNeed("prep", "cpu", 1, 1, SMALL_STAGE_GIB),
        StageNeed("rollout", kind, *_count_range(rollout_replicas * tp, gpu), memory_gib=round(rollout_gib, 2)),
        StageNeed("reward", "cpu", 1, 1, SMALL_STAGE_GIB),
        StageNeed("update", kind, *update_range, memory_gib=round(update_gib, 2)),
        StageNeed("evaluate", "any", 1, 0, round(generate_gib, 2), runs_in="rollout"),
    ]
    if teacher_params > 0:
        teacher_gib = teacher_memory_gib(teacher_params, teacher_bytes_per_param)
        needs.append(StageNeed("teacher", kind, 1, 1, round(teacher_gib, 2), beside=ANCHOR))
    return needs


def teacher_memory_gib(params: int, bytes_per_param: float = 4.0) -> float:
    """GiB a distillation teacher holds: its weights (no gradients, no optimizer state) +1 runtime; its forward's
    activations are one `rollout.batch_size` of rows at a time, inside the runtime margin for the models planned here.

    >>> round(teacher_memory_gib(1_000_000_000, 2), 2)
    2.86
    """
    return params * bytes_per_param / GIB + RUNTIME_GIB


def update_memory_gib(model_params: int, shards: int = 1, reference_bytes: float = 0.0) -> float:
    """GiB per update process: 16 bytes/param (fp32 weights, grads, AdamW moments) + `reference_bytes` (a reference
    model's weights), / shards, x1.25, +1 runtime.

    >>> round(update_memory_gib(7_615_616_512), 1), round(update_memory_gib(7_615_616_512, shards=8), 1)
    (142.9, 18.7)
    >>> round(update_memory_gib(7_615_616_512, shards=8, reference_bytes=4), 1)  # an fp32 reference, sharded too
    23.2
    """
    per_param = UPDATE_BYTES_PER_PARAM + reference_bytes
    return model_params * per_param * ACTIVATION_MARGIN / shards / GIB + RUNTIME_GIB


def _fewest_shards(per_shards: Callable[[int], float], gpu_memory_gib: float, most: int = 1024) -> int:
    """The fewest FSDP ranks whose per-rank update memory (`per_shards(n)` GiB) fits one GPU of `gpu_memory_gib`
    (1 if unknown; `most` when none does: the plan then says it does not fit)."""
    if gpu_memory_gib <= RUNTIME_GIB:
        return 1
    return next((n for n in range(1, most + 1) if per_shards(n) <= gpu_memory_gib), most)


def _count_range(n: int, gpu: bool) -> tuple[int, int]:
    if n > 0:
        return n, n
    return 1, (0 if gpu else 1)


@dataclass(frozen=True)
class Placement:
    """One pool's (so one host's) share of a stage."""

    pool: str
    host: str
    devices: tuple[int, ...]
    """GPU indices on `host`; empty for cpu."""
    processes: int
    work_pool: str


@dataclass(frozen=True)
class Assignment:
    """Where one stage runs. Usually one placement; `update` spanning hosts has one per host, rank-0's first.
    `pool`, `host`, `devices` and `work_pool` are those of the first placement (where rank 0 / the launcher runs);
    `processes` is the total over all placements."""

    stage: str
    kind: Literal["cpu", "gpu"]
    placements: tuple[Placement, ...]
    colocated_with: tuple[str, ...]
    """Stages sharing a GPU (gpu) or the same cpu pool (cpu) with this one."""
    reason: str

    @property
    def pool(self) -> str:
        return self.placements[0].pool

    @property
    def host(self) -> str:
        return self.placements[0].host

    @property
    def devices(self) -> tuple[int, ...]:
        return self.placements[0].devices

    @property
    def work_pool(self) -> str:
        return self.placements[0].work_pool

    @property
    def processes(self) -> int:
        return sum(p.processes for p in self.placements)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(p.host for p in self.placements)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(p.pool for p in self.placements)


@dataclass(frozen=True)
class Plan:
    assignments: tuple[Assignment, ...]

    def for_stage(self, name: str) -> Assignment:
        for a in self.assignments:
            if a.stage == name:
                return a
        raise PlanError(f"plan has no stage {name!r}; it has {', '.join(a.stage for a in self.assignments)}")

    def to_dict(self) -> dict[str, Any]:
        return {"assignments": [_assignment_to_dict(a) for a in self.assignments]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "plan") -> Plan:
        try:
            return cls(tuple(_assignment_from_dict(a) for a in d["assignments"]))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{source}: not a weaver plan ({type(e).__name__}: {e}); re-create it with plan()") from e

    def table(self) -> str:
        header = ("stage", "pool", "host", "procs", "devices", "shares with", "work pool", "reason")
        rows = [header]
        for a in self.assignments:
            for i, p in enumerate(a.placements):
                first = i == 0
                rows.append(
                    (
                        a.stage if first else "",
                        p.pool,
                        p.host,
                        str(p.processes),
                        _ranges(p.devices) if p.devices else "-",
                        (",".join(a.colocated_with) or "-") if first else "",
                        p.work_pool or "(in-process)",
                        a.reason if first else "",
                    )
                )
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _assignment_to_dict(a: Assignment) -> dict[str, Any]:
    d = asdict(a)
    d["colocated_with"] = list(a.colocated_with)
    d["placements"] = [{**asdict(p), "devices": list(p.devices)} for p in a.placements]
    return d


def _assignment_from_dict(d: dict[str, Any]) -> Assignment:
    placements = tuple(Placement(**{**p, "devices": tuple(int(x) for x in p["devices"])}) for p in d["placements"])
    if not placements or d["kind"] not in ("cpu", "gpu"):
        raise ValueError(f"stage {d['stage']!r} needs a kind (cpu/gpu) and at least one placement")
    return Assignment(d["stage"], d["kind"], placements, tuple(d["colocated_with"]), d["reason"])


def _ranges(xs: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 6) -> '0-3,6'."""
    parts: list[str] = []
    start = prev = xs[0]
    for x in (*xs[1:], None):
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


# ---------------------------------------------------------------------------------------------------- planning

Slot = tuple[Pool, int]  # (pool, GPU index)
Placer = Callable[[list[StageNeed], list[Pool]], dict[str, list[Slot]]]


@dataclass(frozen=True)
class _Draft:
    stage: str
    kind: Literal["cpu", "gpu"]
    placements: tuple[Placement, ...]
    reason: str


def plan(stages: list[StageNeed], pools: list[Pool]) -> Plan:
    """Assign every stage to pools (see the module docstring for the rules). Pure and deterministic."""
    try:
        return _plan(stages, pools)
    except PlanError as e:
        if (fewer := _room_for_beside(stages, pools, e)) is not None:
            return fewer
        raise


def _room_for_beside(stages: list[StageNeed], pools: list[Pool], err: PlanError) -> Plan | None:
    """Rule 8, last resort: a stage placed beside another that no GPU has room for (`err`) gets one when the other
    stage gives up devices, one at a time down to its minimum (update spread over every GPU leaves no GPU with room
    for a teacher; one GPU fewer for update frees one). None when that does not help either."""
    n = next((s for s in stages if s.name == err.stage and s.beside), None)
    if n is None or n.kind == "cpu":
        return None
    anchor = next(s for s in stages if s.name == n.beside)
    if anchor.kind != "gpu":
        return None
    had = _plan([s for s in stages if s is not n], pools).for_stage(anchor.name)
    had_count = sum(len(p.devices) for p in had.placements)
    for count in range(had_count - 1, anchor.min_devices - 1, -1):
        try:
            trial = _plan([replace(s, max_devices=count) if s is anchor else s for s in stages], pools)
        except PlanError:
            continue
        fewer = trial.for_stage(anchor.name)
        why = replace(fewer, reason=f"{fewer.reason}; {count} GPUs, not {had_count}: room for {n.name}")
        return Plan(tuple(why if a.stage == anchor.name else a for a in trial.assignments))
    return None


def _plan(stages: list[StageNeed], pools: list[Pool]) -> Plan:
    _validate_stages(stages)
    validate_pools(list(pools))
    gpu_pools = [p for p in pools if p.kind == "gpu" and not p.stages]  # reserved gpu pools: rule 8 only
    cpu_pools = [p for p in pools if p.kind == "cpu"]
    gpu_needs = [s for s in stages if s.kind == "gpu" and not s.runs_in and not s.beside]
    gpu_slots, reasons = _place_gpu_stages(gpu_needs, gpu_pools)
    used = _memory_in_use(gpu_needs, gpu_slots)
    drafts: dict[str, _Draft] = {}
    for s in stages:
        if s.runs_in or s.beside:
            continue
        if s.kind == "gpu":
            drafts[s.name] = _Draft(s.name, "gpu", _placements(gpu_slots[s.name]), reasons[s.name])
        elif s.kind == "cpu":
            drafts[s.name] = _place_cpu(s, cpu_pools, "")
        else:
            drafts[s.name] = _place_any(s, gpu_pools, cpu_pools, used)
    for s in stages:
        if s.beside:
            anchor = next(a for a in stages if a.name == s.beside)
            drafts[s.name] = _place_beside(s, drafts[s.beside], anchor.memory_gib, pools, used)
        elif s.runs_in:
            drafts[s.name] = _place_inside(s, drafts[s.runs_in])
    ordered = [drafts[s.name] for s in stages]
    return Plan(tuple(_with_colocation(d, ordered) for d in ordered))


def _validate_stages(stages: list[StageNeed]) -> None:
    if not stages:
        raise PlanError("no stages to plan; pass stage_needs(...) or a list of StageNeed")
    names = [s.name for s in stages]
    for s in stages:
        if names.count(s.name) > 1:
            raise PlanError(f"stage {s.name!r} is listed twice; each stage is planned once")
        if s.kind not in ("cpu", "gpu", "any"):
            raise PlanError(f"stage {s.name!r}: kind {s.kind!r} is not cpu, gpu or any")
        if s.min_devices < 1 or s.max_devices < 0 or (s.max_devices and s.max_devices < s.min_devices):
            raise PlanError(
                f"stage {s.name!r}: need 1 <= min_devices <= max_devices (or max_devices 0 = all), "
                f"got {s.min_devices}..{s.max_devices}"
            )
        if s.memory_gib < 0:
            raise PlanError(f"stage {s.name!r}: memory_gib must be >= 0, got {s.memory_gib}")
        hosts = [h for h in stages if h.name == s.runs_in and not h.runs_in]
        if s.runs_in and not hosts:
            raise PlanError(f"stage {s.name!r}: runs_in={s.runs_in!r} must name another planned stage that runs itself")
        anchors = [a for a in stages if a.name == s.beside and a.name != s.name and not (a.runs_in or a.beside)]
        if s.beside and (s.runs_in or not anchors):
            raise PlanError(f"stage {s.name!r}: beside={s.beside!r} must name another planned stage that runs itself")


# --- gpu stages ---


def _place_gpu_stages(needs: list[StageNeed], pools: list[Pool]) -> tuple[dict[str, list[Slot]], dict[str, str]]:
    """Rules 2-4: returns stage -> slots and stage -> reason."""
    if not needs:
        return {}, {}
    if not pools:
        raise PlanError(f"{needs[0].name} needs a GPU but no gpu pool is declared; add one (kind: gpu) or plan for CPU")
    needs = sorted(needs, key=lambda n: n.name != ANCHOR)  # stable: update first, others in stage order
    for n in needs:
        _check_alone(n, pools)
    if len(needs) == 1:
        slots = _place_apart(needs, pools)
        return slots, _reasons(needs, f"only GPU stage: {_gib(needs[0].memory_gib)} per GPU", slots)
    apart = _attempt(_place_apart, needs, pools)
    if apart is not None and all(n.max_devices and len(apart[n.name]) == n.max_devices for n in needs):
        return apart, _reasons(needs, "own GPUs: enough devices to give every GPU stage its requested count", apart)
    total = sum(n.memory_gib for n in needs)
    shared = _attempt(_place_shared, needs, pools)
    memories = " + ".join(f"{n.name} {_gib(n.memory_gib)}" for n in needs)
    if shared is not None:
        return shared, _reasons(needs, f"shares GPUs: {memories} fit in {_gib(_min_memory(shared))} per GPU", shared)
    if apart is not None:
        why = f"own GPUs (split): {memories} exceed {_gib(_min_memory(apart))} per GPU"
        return apart, _reasons(needs, why, apart)
    mins = " + ".join(str(n.min_devices) for n in needs)
    raise PlanError(
        f"{' + '.join(n.name for n in needs)} need {mins} GPUs apart, or {max(n.min_devices for n in needs)} "
        f"GPUs with {_gib(total)} each to share them; pools have {_gpu_count(pools)} ({_summary(pools)})"
    )


def _check_alone(n: StageNeed, pools: list[Pool]) -> None:
    """Rule out a stage that could not run even with every GPU to itself, with the plainest message."""
    fit = [s for s in _slots(pools) if s[0].memory_gib >= n.memory_gib]
    if len(fit) < n.min_devices:
        raise PlanError(
            f"{n.name} needs {_gpus(n.min_devices)} with {_gib(n.memory_gib)}{' each' if n.min_devices > 1 else ''}; "
            f"pools have {len(fit)} such ({_summary(pools)})"
        )
    if n.name == ANCHOR and len(_equal_per_host(n, fit)) < n.min_devices:
        raise PlanError(
            f"{n.name} needs {n.min_devices} GPUs with {_gib(n.memory_gib)} each and the same number on each host; "
            f"at most {len(_equal_per_host(n, fit))} fit that way ({_summary(pools)})"
        )


def _place_apart(needs: list[StageNeed], pools: list[Pool]) -> dict[str, list[Slot]]:
    """Rule 4 (and the one-stage case): disjoint devices per stage."""
    free = _slots(pools)
    order = {s: i for i, s in enumerate(free)}
    taken: dict[str, list[Slot]] = {}
    others = [n for n in needs if n.name != ANCHOR]
    for n in others:  # minimums first, smallest fitting GPUs, last devices first
        fit = sorted(_fitting(free, n.memory_gib), key=lambda s: (s[0].memory_gib, -order[s]))
        taken[n.name] = _need(fit[: n.min_devices], n)
        free = [s for s in free if s not in taken[n.name]]
    for n in needs:
        if n.name == ANCHOR:
            taken[n.name] = _need(_equal_per_host(n, _fitting(free, n.memory_gib)), n)
            free = [s for s in free if s not in taken[n.name]]
    for n in others:  # grow up to the maximum with what is left
        room = n.max_devices - len(taken[n.name]) if n.max_devices else len(free)
        extra = _fitting(free, n.memory_gib)[:room]
        taken[n.name] = sorted(taken[n.name] + extra, key=order.__getitem__)
        free = [s for s in free if s not in extra]
    return taken


def _place_shared(needs: list[StageNeed], pools: list[Pool]) -> dict[str, list[Slot]]:
    """Rule 3: every gpu stage on devices that hold them all; others start on update's devices."""
    all_slots = _slots(pools)
    order = {s: i for i, s in enumerate(all_slots)}
    fit = _fitting(all_slots, sum(n.memory_gib for n in needs))
    taken: dict[str, list[Slot]] = {}
    preferred = fit
    if needs[0].name == ANCHOR:
        taken[ANCHOR] = _need(_equal_per_host(needs[0], fit), needs[0])
        preferred = taken[ANCHOR] + [s for s in fit if s not in taken[ANCHOR]]
    for n in needs:
        if n.name != ANCHOR:
            picked = preferred[: n.max_devices or len(preferred)]
            taken[n.name] = sorted(_need(picked, n), key=order.__getitem__)
    return taken


def _equal_per_host(n: StageNeed, fit: list[Slot]) -> list[Slot]:
    """Rule 2: k devices in each of h pools on distinct hosts, maximising k*h (<= max_devices), ties to larger k."""
    by_pool: dict[str, list[Slot]] = {}
    for s in fit:
        by_pool.setdefault(s[0].name, []).append(s)
    best: list[Slot] = []
    for k in range(max((len(v) for v in by_pool.values()), default=0), 0, -1):
        chosen: list[list[Slot]] = []
        hosts: set[str] = set()
        for slots in by_pool.values():
            if len(slots) >= k and slots[0][0].host not in hosts:
                chosen.append(slots[:k])
                hosts.add(slots[0][0].host)
        if n.max_devices:
            chosen = chosen[: n.max_devices // k]
        if k * len(chosen) > len(best):
            best = [s for group in chosen for s in group]
    return best


def _need(picked: list[Slot], n: StageNeed) -> list[Slot]:
    if len(picked) < n.min_devices:
        raise PlanError(f"{n.name}: only {len(picked)} of {n.min_devices} GPUs left")  # caught by _attempt
    return picked


def _attempt(fn: Placer, needs: list[StageNeed], pools: list[Pool]) -> dict[str, list[Slot]] | None:
    try:
        return fn(needs, pools)
    except PlanError:
        return None


def _reasons(needs: list[StageNeed], why: str, taken: dict[str, list[Slot]]) -> dict[str, str]:
    out = {n.name: why for n in needs}
    groups = _placements(taken.get(ANCHOR, []))
    if len(groups) > 1:
        out[ANCHOR] += f"; one launch over {len(groups)} hosts x {groups[0].processes} GPUs"
    return out


def _memory_in_use(needs: list[StageNeed], slots: dict[str, list[Slot]]) -> dict[Slot, float]:
    used: dict[Slot, float] = {}
    for n in needs:
        for s in slots[n.name]:
            used[s] = used.get(s, 0.0) + n.memory_gib
    return used


# --- cpu and any stages ---


def _place_cpu(n: StageNeed, pools: list[Pool], why: str) -> _Draft:
    """Rule 5."""
    if not pools:
        raise PlanError(f"{n.name} needs a cpu pool; declare one (kind: cpu) beside the gpu pools")
    pools = [p for p in pools if n.name in p.stages] + [p for p in pools if not p.stages]
    if not pools:
        raise PlanError(f"{n.name}: every cpu pool is reserved for other stages; add {n.name} to one's `stages`")
    for p in pools:
        if n.min_devices <= p.cpu_cores and (p.memory_gib == 0 or n.memory_gib <= p.memory_gib):
            count = min(n.max_devices or p.cpu_cores, p.cpu_cores)
            reason = f"{why}{count} process{'es' if count > 1 else ''} on {p.cpu_cores} cores"
            return _Draft(n.name, "cpu", (Placement(p.name, p.host, (), count, p.work_pool),), reason)
    raise PlanError(
        f"{n.name} needs {n.min_devices} core{'s' if n.min_devices > 1 else ''} and {_gib(n.memory_gib)} RAM; "
        f"pools have {_summary(pools)}"
    )


def _place_any(n: StageNeed, gpu_pools: list[Pool], cpu_pools: list[Pool], used: dict[Slot, float]) -> _Draft:
    """Rule 6: GPUs with room left, else CPU. Updates `used`."""
    if not gpu_pools:
        return _place_cpu(n, cpu_pools, "no gpu pool; ")
    room = [s for s in _slots(gpu_pools) if s[0].memory_gib - used.get(s, 0.0) >= n.memory_gib]
    picked = room[: n.max_devices or len(room)]
    if len(picked) < n.min_devices:
        return _place_cpu(n, cpu_pools, f"no GPU has {_gib(n.memory_gib)} free beside the GPU stages; ")
    for s in picked:
        used[s] = used.get(s, 0.0) + n.memory_gib
    return _Draft(n.name, "gpu", _placements(picked), f"GPU with room: {_gib(n.memory_gib)} beside the GPU stages")


def _place_inside(n: StageNeed, host: _Draft) -> _Draft:
    """Rule 7: the first `max_devices` devices (or processes) of the stage it runs in."""
    total = sum(p.processes for p in host.placements)
    if total < n.min_devices:
        raise PlanError(f"{n.name} needs {n.min_devices} {host.stage} processes to run in; the plan gives {total}")
    left = n.max_devices or total
    placements = []
    for p in host.placements:
        take = min(left, p.processes)
        if take:
            placements.append(Placement(p.pool, p.host, p.devices[:take], take, p.work_pool))
        left -= take
    return _Draft(n.name, host.kind, tuple(placements), f"runs in {host.stage}'s processes: no extra memory")


def _place_beside(n: StageNeed, anchor: _Draft, anchor_gib: float, pools: list[Pool],
                  used: dict[Slot, float]) -> _Draft:  # fmt: skip
    """Rule 8: a cpu pool reserved for `n`, else beside `anchor` (whose per-device or total memory is `anchor_gib`).
    Updates `used`."""
    cpu_pools = [p for p in pools if p.kind == "cpu"]
    if own := [p for p in cpu_pools if n.name in p.stages]:
        return _place_cpu(n, own, "its own pool; ")
    if n.kind != "cpu" and (own := [p for p in pools if p.kind == "gpu" and n.name in p.stages]):
        return _own_gpu(n, own)
    if anchor.kind == "gpu" and n.kind != "cpu":
        return _beside_gpu(n, anchor, [p for p in pools if p.kind == "gpu" and not p.stages], used)
    home = next((p for p in cpu_pools if p.name == anchor.placements[0].pool), None)
    if home is None:  # a cpu stage beside a gpu one: any cpu pool (rule 5)
        return _place_cpu(n, cpu_pools, "")
    if home.memory_gib and anchor_gib + n.memory_gib > home.memory_gib:
        why = f"{anchor.stage} {_gib(anchor_gib)} + {n.name} {_gib(n.memory_gib)} exceed pool {home.name}'s RAM; "
        return _place_cpu(n, [p for p in cpu_pools if p is not home], why)
    reason = f"beside {anchor.stage} in its pool: 1 process on {home.cpu_cores} cores"
    return _Draft(n.name, "cpu", (Placement(home.name, home.host, (), 1, home.work_pool),), reason)


def _own_gpu(n: StageNeed, own: list[Pool]) -> _Draft:
    """Rule 8 with a gpu pool reserved for `n`: the first of its GPUs (declaration order) with room for it."""
    slot = next((s for s in _slots(own) if s[0].memory_gib >= n.memory_gib), None)
    if slot is None:
        raise PlanError(f"{n.name} needs {_gib(n.memory_gib)} on one GPU; the gpu pools reserved for it have "
                        f"{_summary(own)}: give them GPUs with more memory, or drop {n.name} from their stages",
                        stage=n.name)  # fmt: skip
    pool, device = slot
    reason = f"its own gpu pool; {_gib(n.memory_gib)} of {_gib(pool.memory_gib)}"
    return _Draft(n.name, "gpu", (Placement(pool.name, pool.host, (device,), 1, pool.work_pool),), reason)


def _beside_gpu(n: StageNeed, anchor: _Draft, gpu_pools: list[Pool], used: dict[Slot, float]) -> _Draft:
    """Rule 8 on GPUs: the anchor's first device when it has room for `n`, else the GPU with the most room left."""
    slots = _slots(gpu_pools)
    first = next(s for s in slots if (s[0].name, s[1]) == (anchor.placements[0].pool, anchor.placements[0].devices[0]))
    room = {s: s[0].memory_gib - used.get(s, 0.0) for s in slots}
    best = max(slots, key=lambda s: room[s])  # the first of equals: declaration order
    pick = first if room[first] >= n.memory_gib else best
    if room[pick] < n.memory_gib:
        raise PlanError(
            f"{n.name} needs {_gib(n.memory_gib)} on one GPU; the most any GPU has left beside the other GPU stages "
            f"is {_gib(room[best])} ({_summary(gpu_pools)}): declare a pool (cpu or gpu) with stages: [{n.name}]",
            stage=n.name,
        )
    used[pick] = used.get(pick, 0.0) + n.memory_gib
    where = f"beside {anchor.stage} on its GPU" if pick == first else f"no room beside {anchor.stage}; GPU with room"
    reason = f"{where}: {_gib(n.memory_gib)} of {_gib(room[pick])} left"
    return _Draft(n.name, "gpu", (Placement(pick[0].name, pick[0].host, (pick[1],), 1, pick[0].work_pool),), reason)


def _with_colocation(d: _Draft, drafts: list[_Draft]) -> Assignment:
    mine = _footprint(d)
    shared = tuple(o.stage for o in drafts if o.stage != d.stage and mine & _footprint(o))
    return Assignment(d.stage, d.kind, d.placements, shared, d.reason)


def _footprint(d: _Draft) -> set[tuple[str, int]]:
    """What a stage occupies: (pool, GPU) pairs, or (pool, -1) for a cpu pool as a whole."""
    if d.kind == "cpu":
        return {(p.pool, -1) for p in d.placements}
    return {(p.pool, i) for p in d.placements for i in p.devices}


# --- helpers ---


def _slots(pools: list[Pool]) -> list[Slot]:
    return [(p, i) for p in pools for i in p.devices]


def _fitting(slots: list[Slot], memory_gib: float) -> list[Slot]:
    return [s for s in slots if s[0].memory_gib >= memory_gib]


def _placements(slots: list[Slot]) -> tuple[Placement, ...]:
    by_pool: dict[str, list[Slot]] = {}
    for s in slots:
        by_pool.setdefault(s[0].name, []).append(s)
    return tuple(
        Placement(g[0][0].name, g[0][0].host, tuple(i for _, i in g), len(g), g[0][0].work_pool)
        for g in by_pool.values()
    )


def _min_memory(taken: dict[str, list[Slot]]) -> float:
    return min(s[0].memory_gib for slots in taken.values() for s in slots)


def _gpu_count(pools: list[Pool]) -> int:
    return sum(len(p.devices) for p in pools)


def _summary(pools: list[Pool]) -> str:
    """'gpu: 8 x 80 GiB, big: 2 x 141 GiB' or 'cpu: 16 cores, 64 GiB'."""
    parts = []
    for p in pools:
        if p.kind == "gpu":
            parts.append(f"{p.name}: {len(p.devices)} x {_gib(p.memory_gib)}")
        else:
            ram = _gib(p.memory_gib) if p.memory_gib else "RAM not declared"
            parts.append(f"{p.name}: {p.cpu_cores} cores, {ram}")
    return ", ".join(parts)


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n > 1 else ''}"


def _gib(x: float) -> str:
    return f"{round(x, 1):g} GiB"
