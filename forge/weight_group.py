"""The weight group: trainer rank 0 broadcasts the policy to the rollout engines in packed buckets (torch only).

A process group of its own, built from a `torch.distributed.TCPStore` that trainer rank 0 hosts, never the default
(global) group that the update ranks train on: rank 0 = trainer rank 0, ranks 1..N the receivers (an hf rollout
actor, or one rank per tensor-parallel worker of a vLLM engine). Backend gloo on CPU, NCCL on CUDA: the same code,
which is what makes the path testable on a CPU machine. The group has its own timeout (`DEFAULT_TIMEOUT`, minutes;
the training group's is 30).

Per sync: rank 0 casts each tensor on its own device to the publish dtype and copies it into a flat buffer (a
bucket, one dtype, at most `bucket_bytes` unless one tensor alone is larger), broadcasts the bucket, and goes on to
the next; each receiver receives into a buffer of the same size and hands views of it, as (name, tensor) pairs, to
a load function (hf: copy into the live parameters, bucket by bucket; a vLLM worker keeps the sync's buckets and runs
the model's own `reload_weights` over them at the end). Peak extra memory on the sender is one bucket, never a second
copy of the model; on an hf receiver one bucket, on a vLLM worker one copy in the publish dtype. Only the `WeightPlan` (names, dtypes, shapes, bucket
layout: a few kB) travels by other means (Ray), once per group.

Departures from peers: OpenRLHF and TRL broadcast parameter by parameter (one collective per tensor; buckets here,
as verl's checkpoint engine does), and build their group through vLLM's `StatelessProcessGroup` / PyNccl, which the
trainer's venv cannot import; this module uses torch's own backend classes on both sides. The version label is not
broadcast: the caller passes it to both sides with the call.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=5)
BUCKET_BYTES = 64 << 20

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies: bucket index, element offset in that bucket's flat buffer, shape."""

    name: str
    bucket: int
    offset: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """What a receiver needs to know to unpack a sync: the tensors in send order and each bucket's (dtype, numel)."""

    tensors: tuple[TensorSpec, ...]
    buckets: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n * _dtype(d).itemsize for d, n in self.buckets)


def make_plan(shapes: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], dtype: torch.dtype,
              bucket_bytes: int = BUCKET_BYTES) -> WeightPlan:  # fmt: skip
    """The layout of (name, source dtype, shape) in send order: floating tensors travel as `dtype`, others as they
    are; a new bucket starts when the dtype changes or the bucket would pass `bucket_bytes`.

    >>> p = make_plan([("a", torch.float32, (2, 3)), ("b", torch.float32, (4,)), ("c", torch.int64, (1,))],
    ...               torch.bfloat16, bucket_bytes=16)
    >>> [(t.name, t.bucket, t.offset) for t in p.tensors], p.buckets
    ([('a', 0, 0), ('b', 1, 0), ('c', 2, 0)], (('bfloat16', 6), ('bfloat16', 4), ('int64', 1)))
    """
    if bucket_bytes <= 0:
        raise ValueError(f"weight group: bucket_bytes must be positive, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    buckets: list[list] = []  # [dtype name, numel]
    for name, src, shape in shapes:
        wire = dtype if src.is_floating_point else src
        numel = int(torch.Size(shape).numel())
        fits = buckets and buckets[-1][0] == _name(wire) and (buckets[-1][1] + numel) * wire.itemsize <= bucket_bytes
        if not fits:
            buckets.append([_name(wire), 0])
        specs.append(TensorSpec(name, len(buckets) - 1, buckets[-1][1], tuple(shape)))
        buckets[-1][1] += numel
    return WeightPlan(tuple(specs), tuple((d, n) for d, n in buckets))


def plan_for(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
             bucket_bytes: int = BUCKET_BYTES) -> WeightPlan:  # fmt: skip
    """`make_plan` over live tensors (only their metadata is read)."""
    return make_plan(((n, t.dtype, tuple(t.shape)) for n, t in tensors), dtype, bucket_bytes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightGroup:
    """One member of the weight group. Rank 0 calls `host` (which opens the store) and then `connect`; the
    receivers call `connect` with rank 0's address and port. Every member's `connect` blocks until all have come."""

    def __init__(self, rank: int, world: int, backend: str = "", timeout: timedelta = DEFAULT_TIMEOUT,
                 device: torch.device | None = None):  # fmt: skip
        """`device`: where this member's buckets live; by default the current CUDA device under NCCL, else the CPU.
        A CUDA device with gloo (which stages each bucket through host memory) is how scripts/gpu_check.py runs two
        members on one GPU, where NCCL refuses two ranks."""
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"weight group: rank {rank} of world {world} (needs world >= 2)")
        self.rank, self.world = rank, world
        self.backend = backend or default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group: backend must be gloo or nccl, got {self.backend!r}")
        self.timeout = timeout
        self.store: dist.TCPStore | None = None
        self.pg = None
        if device is None and self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def host(self, address: str, port: int = 0) -> int:
        """Rank 0: open the TCP store on `address` (port 0: a free one); returns the port the receivers connect to."""
        assert self.rank == 0, "only rank 0 hosts the weight group's store"
        self.store = dist.TCPStore(address, port, self.world, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)  # fmt: skip
        return self.store.port

    def connect(self, address: str, port: int, local_address: str = "") -> None:
        """Join the group at rank 0's `address:port` (blocks until every member has joined, within the timeout).
        `local_address`: the address this member's gloo transport binds ($GLOO_SOCKET_IFNAME wins if set)."""
        if self.store is None:
            self.store = dist.TCPStore(address, port, self.world, is_master=False, timeout=self.timeout)
        store = dist.PrefixStore("forgeweave-weights", self.store)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface else
                             dist.ProcessGroupGloo.create_device(hostname=local_address or address)]  # fmt: skip
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.world, opts)
        self._broadcast(torch.zeros(1, device=self.device))  # every member is here (NCCL connects lazily)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = self.timeout
        self.pg.broadcast([buffer], opts).wait()

    def send(self, plan: WeightPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: cast, pack and broadcast `tensors` (in the plan's order, on any device); returns bytes sent."""
        assert self.rank == 0 and self.pg is not None, "send is rank 0's, after connect"
        it = iter(tensors)
        for index, buffer in enumerate(self._empty_buckets(plan)):
            for spec in _in_bucket(plan, index):
                name, t = next(it)
                if name != spec.name:
                    raise ValueError(f"weight group: sending {name!r} where the plan has {spec.name!r}")
                src = t.detach().to(buffer.device)  # on the trainer's device: the cast below runs there too
                buffer[spec.offset : spec.offset + src.numel()].copy_(src.reshape(-1))
            self._broadcast(buffer)
        return plan.nbytes

    def receive(self, plan: WeightPlan, load: Loader) -> int:
        """Ranks 1..N: receive each bucket and hand its (name, view of the buffer) pairs to `load` before the next
        bucket overwrites nothing (each bucket gets a fresh buffer). Returns bytes received."""
        assert self.rank > 0 and self.pg is not None, "receive is for ranks 1..N, after connect"
        for index, buffer in enumerate(self._empty_buckets(plan)):
            self._broadcast(buffer)
            load([(s.name, buffer[s.offset : s.offset + _numel(s)].view(s.shape)) for s in _in_bucket(plan, index)])
        return plan.nbytes

    def _empty_buckets(self, plan: WeightPlan) -> Iterator[torch.Tensor]:
        for dtype, numel in plan.buckets:
            yield torch.empty(numel, dtype=_dtype(dtype), device=self.device)

    def close(self) -> None:
        """Drop the group (a member that died leaves it unusable: the caller builds a new one)."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except (RuntimeError, AttributeError):
                pass
        self.pg = self.store = None


def _in_bucket(plan: WeightPlan, index: int) -> list[TensorSpec]:
    return [s for s in plan.tensors if s.bucket == index]


def _numel(spec: TensorSpec) -> int:
    return int(torch.Size(spec.shape).numel())


def copy_into(module: torch.nn.Module) -> Loader:
    """A loader that copies received tensors into `module`'s own parameters and buffers, in place (tied copies
    share storage, so a tied head follows its embedding)."""
    targets = dict(module.state_dict(keep_vars=True))

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in pairs:
                if name not in targets:
                    raise KeyError(f"weight group: the model has no tensor {name!r}")
                targets[name].data.copy_(tensor)

    return load
