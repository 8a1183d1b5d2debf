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

Transport `ipc` (colocated mode: the receivers share rank 0's device, where NCCL refuses two ranks on one GPU): no
process group; the store carries the buckets' handles and the receivers' acks. Per bucket rank 0 packs the bucket as
above, shares it (`share`: on CUDA torch's IPC handle, `torch.multiprocessing.reductions.reduce_tensor`; on the CPU
a shared-memory file of torch's file_system strategy, which unrelated processes such as two Ray actors can map, unlike
the default file-descriptor strategy that needs a multiprocessing parent), puts the pickled (rebuild, args) in the
store under `<sync>/<bucket>` and waits, within the group's timeout, for every receiver's ack before it drops the
bucket: peak extra sender memory stays one bucket and the bytes never leave the device. A receiver rebuilds the
bucket (mapping the sender's memory, no copy), hands views of it to `load` — which must copy what it keeps, the
memory goes back to the sender after the ack — then acks. Every member checks at connect that it is on rank 0's host
and device (`place`), else one line. The CUDA lines (handle, device index, `ipc_collect`) have run only through the
device check (scripts/gpu_check.py); on the CPU the same protocol runs in the tests.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from forge.errors import UserError

DEFAULT_TIMEOUT = timedelta(minutes=5)
BUCKET_BYTES = 64 << 20
BACKENDS = ("gloo", "nccl", "ipc")

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
        """`backend`: gloo, nccl or ipc (handles through the store; see the module docstring); '' = gloo on CPU,
        nccl on CUDA. `device`: where this member's buckets live; by default the current CUDA device under NCCL (and
        under ipc when CUDA is available), else the CPU. A CUDA device with gloo (which stages each bucket through
        host memory) is how scripts/gpu_check.py runs two members on one GPU, where NCCL refuses two ranks."""
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"weight group: rank {rank} of world {world} (needs world >= 2)")
        self.rank, self.world = rank, world
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"weight group: backend must be gloo, nccl or ipc, got {self.backend!r}")
        self.timeout = timeout
        self.store: dist.TCPStore | None = None
        self.pg = None
        self.syncs = 0  # ipc: syncs sent or received so far (the store keys' prefix)
        cuda = self.backend == "nccl" or (self.backend == "ipc" and torch.cuda.is_available())
        if device is None and cuda:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device or torch.device("cpu")

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
        if self.backend == "ipc":
            self._check_places()
            return
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

    def _ipc_store(self) -> dist.Store:
        return dist.PrefixStore("forgeweave-ipc", self.store)

    def _check_places(self) -> None:
        """ipc: every member publishes its `place` and waits for the others'; rank 0 refuses a group with a member
        elsewhere, and such a member refuses itself, each in one line."""
        store = self._ipc_store()
        store.set(f"place/{self.rank}", place(self.device))
        self._wait(store, {f"place/{r}": r for r in range(self.world)}, "join the group")
        places = [store.get(f"place/{r}").decode() for r in range(self.world)]
        away = [r for r in range(1, self.world) if places[r] != places[0]]
        if away and (self.rank == 0 or self.rank in away):
            r = self.rank if self.rank else away[0]
            raise UserError(
                f"weight group (ipc): rank {r} is on {places[r]}, rank 0 on {places[0]}: CUDA IPC needs every "
                "receiver on update rank 0's host and device (set rollout.weight_transport=group)"
            )

    def _wait(self, store: dist.Store, keys: dict[str, int], what: str) -> None:
        """Wait for `keys` (key -> the rank that writes it) within the group's timeout; else one line naming the
        ranks that did not answer."""
        try:
            store.wait(list(keys), self.timeout)
        except dist.DistStoreError:
            missing = sorted({r for k, r in keys.items() if not store.check([k])})
            raise RuntimeError(
                f"weight group (ipc): rank {self.rank} waited {self.timeout.total_seconds():.0f} s to {what}, no word "
                f"from rank {', '.join(map(str, missing))} (died or hangs): rebuild the group"
            ) from None

    def _broadcast(self, buffer: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = self.timeout
        self.pg.broadcast([buffer], opts).wait()

    def send(self, plan: WeightPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: cast, pack and broadcast `tensors` (in the plan's order, on any device); returns bytes sent."""
        assert self.rank == 0 and self.store is not None, "send is rank 0's, after connect"
        if self.backend == "ipc":
            return self._send_ipc(plan, iter(tensors))
        it = iter(tensors)
        for index, buffer in enumerate(self._empty_buckets(plan)):
            _pack(plan, index, buffer, it)
            self._broadcast(buffer)
        return plan.nbytes

    def _send_ipc(self, plan: WeightPlan, it: Iterator[tuple[str, torch.Tensor]]) -> int:
        """ipc: per bucket, pack it in shareable memory, put its handle in the store, wait for every receiver's ack,
        then drop it (and the keys)."""
        store, sync = self._ipc_store(), self.syncs
        self.syncs += 1
        for index, (dtype, numel) in enumerate(plan.buckets):
            bucket = shareable(numel, _dtype(dtype), self.device)
            _pack(plan, index, bucket, it)
            if bucket.is_cuda:  # the receivers read the bytes as soon as they see the handle
                torch.cuda.synchronize(bucket.device)
            key = f"{sync}/{index}"
            store.set(key, pickle.dumps(share(bucket)))
            acks = {f"{key}/ack/{r}": r for r in range(1, self.world)}
            self._wait(store, acks, f"have bucket {index} of sync {sync} acked")
            for k in (key, *acks):
                store.delete_key(k)
            del bucket
            if self.device.type == "cuda":  # let torch free the blocks the receivers have let go of
                torch.cuda.ipc_collect()
        return plan.nbytes

    def _receive_ipc(self, plan: WeightPlan, load: Loader) -> int:
        """ipc: per bucket, wait for its handle, map the sender's memory, `load` views of it, ack."""
        store, sync = self._ipc_store(), self.syncs
        self.syncs += 1
        for index in range(len(plan.buckets)):
            key = f"{sync}/{index}"
            self._wait(store, {key: 0}, f"receive bucket {index} of sync {sync}")
            bucket = rebuild(load_handle(store.get(key)), self.device)
            load([(s.name, bucket[s.offset : s.offset + _numel(s)].view(s.shape)) for s in _in_bucket(plan, index)])
            del bucket
            if self.device.type == "cuda":  # the copies out of the sender's memory are done before it is freed
                torch.cuda.synchronize(self.device)
            store.set(f"{key}/ack/{self.rank}", b"1")
        return plan.nbytes

    def receive(self, plan: WeightPlan, load: Loader) -> int:
        """Ranks 1..N: receive each bucket and hand its (name, view of the buffer) pairs to `load` before the next
        bucket overwrites nothing (each bucket gets a fresh buffer; under ipc the views are of the sender's memory,
        which goes back to it once `load` returns: `load` copies what it keeps). Returns bytes received."""
        assert self.rank > 0 and self.store is not None, "receive is for ranks 1..N, after connect"
        if self.backend == "ipc":
            return self._receive_ipc(plan, load)
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


def _pack(plan: WeightPlan, index: int, buffer: torch.Tensor, it: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Cast bucket `index`'s tensors (the next ones of `it`, in the plan's order) into `buffer`."""
    for spec in _in_bucket(plan, index):
        name, t = next(it)
        if name != spec.name:
            raise ValueError(f"weight group: sending {name!r} where the plan has {spec.name!r}")
        src = t.detach().to(buffer.device)  # on the trainer's device: the cast below runs there too
        buffer[spec.offset : spec.offset + src.numel()].copy_(src.reshape(-1))


def place(device: torch.device) -> str:
    """Where a member's memory is, for ipc: host (name and boot id) and device (a CUDA device's UUID, else cpu)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    where = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"
    return f"{socket.gethostname()}/{boot}/{where}"


def shareable(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty 1-D tensor that other processes can map: CUDA memory (IPC-able as it is), or on the CPU one
    allocated straight in a shared-memory file (file_system strategy), so sharing it copies nothing."""
    if device.type == "cuda":
        return torch.empty(numel, dtype=dtype, device=device)
    storage = torch.UntypedStorage._new_using_filename_cpu(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,))


def share(bucket: torch.Tensor) -> tuple:
    """A picklable (rebuild function, args) that maps `bucket` in another process on the same host (and device)."""
    if bucket.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(bucket)
    return _rebuild_cpu, (bucket.untyped_storage()._share_filename_cpu_(), _name(bucket.dtype), bucket.numel())


def rebuild(shared: tuple, device: torch.device) -> torch.Tensor:
    """The tensor `share` described, mapped into this process; a CUDA handle is opened on `device` (this process's
    index of the same GPU: the sender's index may name another GPU under another CUDA_VISIBLE_DEVICES)."""
    fn, args = shared
    if device.type == "cuda":  # reduce_tensor's args: (..., dtype, device index, handle, ...)
        args = (*args[:6], device.index, *args[7:])
    return fn(*args)


_HANDLE_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),  # what reduce_tensor names for a CUDA tensor
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("forge.weight_group", "_rebuild_cpu"),
}


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles a bucket handle and nothing else: the store is a TCP port on the node, so a payload written there by
    another process must not run code here. Only the rebuild functions, torch's tensor/storage/Size classes and
    dtypes resolve; any other global is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _HANDLE_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"weight group (ipc): a handle may not name {module}.{name}")


def load_handle(data: bytes) -> tuple:
    """The (rebuild, args) that `share` made, from the store's bytes (`_HandleUnpickler`: no other code runs).

    >>> import os
    >>> load_handle(pickle.dumps((os.system, ("true",))))
    Traceback (most recent call last):
    _pickle.UnpicklingError: weight group (ipc): a handle may not name posix.system
    """
    return _HandleUnpickler(io.BytesIO(data)).load()


def _rebuild_cpu(handle: tuple, dtype: str, numel: int) -> torch.Tensor:
    manager, filename, size = handle
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, filename, size)
    return torch.empty(0, dtype=_dtype(dtype)).set_(storage, 0, (numel,))


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
