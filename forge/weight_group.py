"""The weight group: trainer rank 0 broadcasts the policy to the rollout engines in packed buckets (torch only).

A process group of its own, built from a `torch.distributed.TCPStore` that trainer rank 0 hosts, never the default
(global) group that the update ranks train on: rank 0 = trainer rank 0, ranks 1..N the receivers (an hf rollout
actor, or one rank per tensor-parallel worker of a vLLM engine). Backend gloo on CPU, NCCL on CUDA: the same code,
which is what makes the path testable on a CPU machine. The group has its own timeout (`DEFAULT_TIMEOUT`, minutes;
the training group's is 30).

Per sync: rank 0 casts each tensor on its own device to the publish dtype and copies it into a flat buffer (a
bucket, one dtype, at most `bucket_bytes` unless one tensor alone is larger), broadcasts the bucket, and goes on to
the next; each receiver receives into a buffer of the same size and hands views of it, as (name, tensor) pairs, to
a load function (hf: copy into the live parameters, bucket by bucket; a vLLM worker runs the model's own
`reload_weights` over `stream`, an iterator that receives the next bucket only when the loader asks for its first
tensor, each a copy of that tensor alone). Peak extra memory on the sender is one bucket, never a second copy of the
model; on a receiver one bucket (plus, under vLLM, the copies its loader itself keeps while it fuses a layer's parts).
Only the `WeightPlan` (names, dtypes, shapes, bucket layout: a few kB) travels by other means (Ray), once per group.

A LoRA policy feeding hf copies sends only its adapter (the copies hold the base and an adapter of the same config;
`forge.workers.publishes_adapter`): the plan then lists the lora_A/lora_B tensors alone and carries rank 0's
fingerprints of the base (`WeightPlan.frozen`), which each receiver checks against its own copy when it joins
(`check_frozen`). Into a vLLM engine the trainer streams the merged weights, each computed as it is packed.

Every sync begins with each receiver saying it is ready (a signed store key) and rank 0 waiting for all of them
(`ready_timeout`) before the first bucket: a receive queued behind other work (asynchronous GRPO's generate calls)
never leaves rank 0 inside an open collective whose timeout (NCCL's watchdog) runs while the receiver is busy.

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

Trust: the members share a per-run secret (`weight_secret`: $FORGEWEAVE_WEIGHT_SECRET, made by the driver and handed
to its stage processes in their environment, never in argv). The store listens only on the address it is hosted on
(a socket bound there first and handed to torch: torch's own store binds every interface), and under ipc on
127.0.0.1. At connect every member proves it holds the secret (an HMAC of rank 0's fresh nonce and its rank) and
rank 0 proves it back, before any process group forms or any handle is read; every value the ipc transport puts in
the store (handles, acks) carries an HMAC of its key and bytes, checked before it is used, and a handle is accepted
only if it is the one rebuild the sender's device produces, for exactly the dtype and size of its bucket in the
`WeightPlan`. Not covered: the bytes of a gloo/NCCL broadcast travel unsigned over the group's own connections (a
peer cannot join without the secret, but the transport is not encrypted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import json
import os
import pickle
import secrets
import socket
import zlib
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from forge.errors import UserError

DEFAULT_TIMEOUT = timedelta(minutes=5)
BUCKET_BYTES = 64 << 20
BACKENDS = ("gloo", "nccl", "ipc")
SECRET_ENV = "FORGEWEAVE_WEIGHT_SECRET"
MAC_BYTES = 32

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
    """What a receiver needs to know to unpack a sync: the tensors in send order and each bucket's (dtype, numel).
    `frozen`: where a sync sends only part of the model (a LoRA adapter), rank 0's fingerprints (`fingerprint`, sync
    `FROZEN_SYNC`) of the rest, which every receiver must hold already (`WeightGroup.check_frozen`)."""

    tensors: tuple[TensorSpec, ...]
    buckets: tuple[tuple[str, int], ...]
    frozen: tuple[tuple[str, float], ...] = ()

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


def weight_secret() -> bytes:
    """The run's weight-group secret: $FORGEWEAVE_WEIGHT_SECRET (hex), made here (and put in this process's
    environment, which child processes and the stage actors the driver starts inherit) if it is not set yet."""
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        value = os.environ[SECRET_ENV] = secrets.token_hex(32)
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise UserError(f"${SECRET_ENV} must be hex (it is made by forgeweave; unset it to get a fresh one)") from None


def mac(secret: bytes, key: str, data: bytes) -> bytes:
    """HMAC-SHA256 of a store value `data` under store key `key`."""
    return hmac.new(secret, key.encode() + b"\0" + data, hashlib.sha256).digest()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightGroup:
    """One member of the weight group. Rank 0 calls `host` (which opens the store) and then `connect`; the
    receivers call `connect` with rank 0's address and port. Every member's `connect` blocks until all have come."""

    def __init__(self, rank: int, world: int, backend: str = "", timeout: timedelta = DEFAULT_TIMEOUT,
                 device: torch.device | None = None, secret: bytes | None = None, check: bool = True,
                 ready_timeout: timedelta | None = None):  # fmt: skip
        """`backend`: gloo, nccl or ipc (handles through the store; see the module docstring); '' = gloo on CPU,
        nccl on CUDA. `device`: where this member's buckets live; by default the current CUDA device under NCCL (and
        under ipc when CUDA is available), else the CPU. A CUDA device with gloo (which stages each bucket through
        host memory) is how scripts/gpu_check.py runs two members on one GPU, where NCCL refuses two ranks.
        `secret`: the members' shared secret (default `weight_secret()`). `check` (rank 0's; the receivers follow
        it): every sync's integrity check (`fingerprint`). `ready_timeout` (rank 0's): how long a `send` waits for
        every receiver to begin the sync before any bucket moves (default: `timeout`); longer where receives queue
        behind other work (asynchronous GRPO: behind the generate calls in flight), so that no collective is open,
        and no timeout runs, while a receiver is still busy."""
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"weight group: rank {rank} of world {world} (needs world >= 2)")
        self.rank, self.world = rank, world
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"weight group: backend must be gloo, nccl or ipc, got {self.backend!r}")
        self.timeout = timeout
        self.ready_timeout = ready_timeout or timeout
        self.secret = secret if secret is not None else weight_secret()
        self.store: dist.TCPStore | None = None
        self.pg = None
        self.syncs = 0  # syncs sent or received so far (the store keys' prefix)
        self.check = check  # rank 0's setting; a receiver reads it from the store at connect
        self.sent: dict[str, float] = {}  # the last sync's fingerprints as rank 0 sent them (receivers: read back)
        cuda = self.backend == "nccl" or (self.backend == "ipc" and torch.cuda.is_available())
        if device is None and cuda:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device or torch.device("cpu")

    def host(self, address: str, port: int = 0) -> int:
        """Rank 0: open the TCP store on `address` only (ipc: on 127.0.0.1; port 0: a free one); returns the port the
        receivers connect to."""
        assert self.rank == 0, "only rank 0 hosts the weight group's store"
        address = "127.0.0.1" if self.backend == "ipc" else address
        listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(128)
        port = listener.getsockname()[1]  # the store owns the socket from here (it closes it)
        self.store = dist.TCPStore(address, port, self.world, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False, master_listen_fd=listener.detach())  # fmt: skip
        self.store.set("auth/nonce", secrets.token_bytes(16))
        self._put(self.store, "check", b"1" if self.check else b"0")
        return self.store.port

    def connect(self, address: str, port: int, local_address: str = "") -> None:
        """Join the group at rank 0's `address:port` (blocks until every member has joined, within the timeout).
        `local_address`: the address this member's gloo transport binds ($GLOO_SOCKET_IFNAME wins if set). Every
        member proves the run's secret first (`_authenticate`)."""
        if self.store is None:
            address = "127.0.0.1" if self.backend == "ipc" else address  # ipc: every member is on rank 0's host
            self.store = dist.TCPStore(address, port, self.world, is_master=False, timeout=self.timeout)
        self._authenticate()
        self.check = self._get_signed(self.store, "check") == b"1"
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

    def check_loaded(self, plan: WeightPlan, tensors: dict[str, torch.Tensor]) -> None:
        """After a receive: the engine's live `tensors` (name -> tensor, any dtype) hold what rank 0 sent in the last
        sync (its fingerprints, cast to the publish dtype), else one line naming the tensor: a load that did not take
        (the engine would go on sampling from old weights)."""
        if not self.check:
            return
        dtypes = {s.name: _dtype(plan.buckets[s.bucket][0]) for s in plan.tensors}
        live = fingerprint(((name, tensors[name]) for name in dtypes), self.syncs - 1, dtypes)
        if bad := differs(self.sent, live):
            raise RuntimeError(f"weight group: rank {self.rank}: after sync {self.syncs - 1} the engine's {bad} is not "
                               "what rank 0 sent: the load did not take, the engine holds other weights")  # fmt: skip

    def check_frozen(self, plan: WeightPlan, tensors: dict[str, torch.Tensor]) -> None:
        """At join, for a plan that sends only part of the model (`plan.frozen`: a LoRA adapter's): the receiver's
        own copy of the rest (`tensors`, name -> tensor) is rank 0's, else one line naming the tensor: an adapter
        applied to another base would sample from another policy, and no sync would ever say so."""
        if not self.check or not plan.frozen:
            return
        sent = dict(plan.frozen)
        live = fingerprint(((name, tensors[name]) for name in sent if name in tensors), FROZEN_SYNC)
        if bad := differs(sent, live):
            raise RuntimeError(f"weight group: rank {self.rank}: this engine's {bad} is not rank 0's: the syncs carry "
                               "only the adapter, and the base model it was loaded with differs from the trainer's "
                               "(model.path, model.dtype and the seed must be the run's)")  # fmt: skip

    def _ipc_store(self) -> dist.Store:
        return dist.PrefixStore("forgeweave-ipc", self.store)

    def _authenticate(self) -> None:
        """Each member writes an HMAC of rank 0's nonce and its rank; rank 0 checks every one before the group forms,
        and every member checks rank 0's: a process without the run's secret can neither join nor pose as rank 0."""
        self._wait(self.store, {"auth/nonce": 0}, "read rank 0's nonce")
        nonce = self.store.get("auth/nonce")
        self.store.set(f"auth/{self.rank}", mac(self.secret, f"auth/{self.rank}", nonce))
        members = [0] if self.rank else range(self.world)
        self._wait(self.store, {f"auth/{r}": r for r in members}, "prove the run's secret")
        for r in members:
            if not hmac.compare_digest(self.store.get(f"auth/{r}"), mac(self.secret, f"auth/{r}", nonce)):
                raise UserError(
                    f"weight group: rank {r} does not hold this run's secret (${SECRET_ENV}): another process "
                    f"answered on the group's port, or the members were started by different runs; rebuild the group"
                )

    def _put(self, store: dist.Store, key: str, data: bytes) -> None:
        store.set(key, mac(self.secret, key, data) + data)

    def _get_signed(self, store: dist.Store, key: str) -> bytes:
        """A value `_put` wrote, its HMAC checked: a forged or altered value stops the sync with one line."""
        raw = store.get(key)
        data = raw[MAC_BYTES:]
        if not hmac.compare_digest(raw[:MAC_BYTES], mac(self.secret, key, data)):
            raise RuntimeError(f"weight group (ipc): rank {self.rank}: the store's value under {key!r} is not signed "
                               "with this run's secret (written by another process): refusing it")  # fmt: skip
        return data

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

    def _wait(self, store: dist.Store, keys: dict[str, int], what: str, timeout: timedelta | None = None) -> None:
        """Wait for `keys` (key -> the rank that writes it) within `timeout` (the group's); else one line naming the
        ranks that did not answer."""
        timeout = timeout or self.timeout
        try:
            store.wait(list(keys), timeout)
        except dist.DistStoreError:
            missing = sorted({r for k, r in keys.items() if not store.check([k])})
            raise RuntimeError(
                f"weight group ({self.backend}): rank {self.rank} waited {timeout.total_seconds():.0f} s to {what}, "
                f"no word from rank {', '.join(map(str, missing))} (died or hangs): rebuild the group"
            ) from None

    def _ready(self, sync: int) -> None:
        """A receiver: say it has begun sync `sync` (rank 0 sends nothing before every receiver has)."""
        self._put(self.store, f"ready/{sync}/{self.rank}", b"1")

    def _await_ready(self, sync: int) -> None:
        """Rank 0: wait, within `ready_timeout`, until every receiver has begun sync `sync`."""
        keys = {f"ready/{sync}/{r}": r for r in range(1, self.world)}
        self._wait(self.store, keys, f"see every receiver begin sync {sync}", self.ready_timeout)
        for k in keys:
            self._get_signed(self.store, k)
            self.store.delete_key(k)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = self.timeout
        self.pg.broadcast([buffer], opts).wait()

    def send(self, plan: WeightPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: cast, pack and broadcast `tensors` (in the plan's order, on any device); returns bytes sent. With
        the check on, the fingerprints of what was packed go to the store (signed) for the receivers to compare."""
        assert self.rank == 0 and self.store is not None, "send is rank 0's, after connect"
        sync, self.syncs, self.sent = self.syncs, self.syncs + 1, {}
        self._await_ready(sync)
        if self.backend == "ipc":
            self._send_ipc(plan, iter(tensors), sync)
            return plan.nbytes
        it = iter(tensors)
        for index, buffer in enumerate(self._empty_buckets(plan)):
            _pack(plan, index, buffer, it)
            self._note(plan, index, buffer, sync, self.sent)
            self._broadcast(buffer)
        self._publish_fingerprints(sync)
        return plan.nbytes

    def _publish_fingerprints(self, sync: int) -> None:
        if self.check:
            self._put(self.store, f"fp/{sync}", json.dumps(self.sent).encode())
            self.store.delete_key(f"fp/{sync - 3}")  # read long ago: every receiver finished that sync since

    def _note(self, plan: WeightPlan, index: int, bucket: torch.Tensor, sync: int, into: dict) -> None:
        if self.check:
            into.update(fingerprint(_views(plan, index, bucket), sync))

    def _verify(self, got: dict[str, float], sync: int) -> None:
        """A receiver: what arrived against what rank 0 sent (its signed fingerprints); a difference stops the sync
        with one line naming the tensor."""
        if not self.check:
            return
        self._wait(self.store, {f"fp/{sync}": 0}, f"read rank 0's fingerprints of sync {sync}")
        self.sent = json.loads(self._get_signed(self.store, f"fp/{sync}"))
        if bad := differs(self.sent, got):
            raise RuntimeError(f"weight group: rank {self.rank}: sync {sync}: {bad} arrived other than rank 0 sent "
                               "it (corrupted in transit): this engine does not hold the trainer's weights")  # fmt: skip

    def _send_ipc(self, plan: WeightPlan, it: Iterator[tuple[str, torch.Tensor]], sync: int) -> None:
        """ipc: per bucket, pack it in shareable memory, put its handle in the store, wait for every receiver's ack,
        then drop it (and the keys)."""
        store = self._ipc_store()
        for index, (dtype, numel) in enumerate(plan.buckets):
            bucket = shareable(numel, _dtype(dtype), self.device)
            _pack(plan, index, bucket, it)
            self._note(plan, index, bucket, sync, self.sent)
            if bucket.is_cuda:  # the receivers read the bytes as soon as they see the handle
                torch.cuda.synchronize(bucket.device)
            key = f"{sync}/{index}"
            self._put(store, key, pickle.dumps(share(bucket)))
            if index == len(plan.buckets) - 1:  # all packed: the receivers can check as soon as they have it
                self._publish_fingerprints(sync)
            acks = {f"{key}/ack/{r}": r for r in range(1, self.world)}
            self._wait(store, acks, f"have bucket {index} of sync {sync} acked")
            for k in acks:
                self._get_signed(store, k)
            for k in (key, *acks):
                store.delete_key(k)
            del bucket
            if self.device.type == "cuda":  # let torch free the blocks the receivers have let go of
                torch.cuda.ipc_collect()

    def _receive_ipc(self, plan: WeightPlan, load: Loader, sync: int, got: dict) -> None:
        """ipc: per bucket, wait for its handle, map the sender's memory, `load` views of it, ack."""
        store = self._ipc_store()
        for index in range(len(plan.buckets)):
            bucket = self._ipc_bucket(store, plan, sync, index)
            self._note(plan, index, bucket, sync, got)
            load(_views(plan, index, bucket))
            del bucket
            self._ack(store, sync, index)

    def _ipc_bucket(self, store: dist.Store, plan: WeightPlan, sync: int, index: int) -> torch.Tensor:
        """ipc: bucket `index` of sync `sync`, mapped from the sender's memory once its signed handle is there."""
        key = f"{sync}/{index}"
        self._wait(store, {key: 0}, f"receive bucket {index} of sync {sync}")
        raw = self._get_signed(store, key)
        return rebuild(
            checked_handle(load_handle(raw, self.device.type), plan.buckets[index], self.device), self.device
        )

    def _ack(self, store: dist.Store, sync: int, index: int) -> None:
        if self.device.type == "cuda":  # the copies out of the sender's memory are done before it is freed
            torch.cuda.synchronize(self.device)
        self._put(store, f"{sync}/{index}/ack/{self.rank}", b"1")

    def stream(self, plan: WeightPlan) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..N: one sync as an iterator of (name, tensor) pairs that a loader consumes as they come (a vLLM
        worker's `reload_weights`): bucket k + 1 is received only once bucket k's pairs were taken. Each pair is a
        copy of its tensor alone, so the receiver holds one receive buffer plus the tensors its loader keeps, never a
        second copy of the model: vLLM's loader keeps a fused module's parts until the last arrives (and, with tied
        embeddings, the embedding to the end), and a view would keep its whole bucket alive with it. Under ipc the
        bucket's copies are made before its ack (the sender's memory goes back then). The loader must take every
        pair: the sync's buckets are a collective."""
        assert self.rank > 0 and self.store is not None, "stream is for ranks 1..N, after connect"
        sync, self.syncs, got = self.syncs, self.syncs + 1, {}
        self._ready(sync)
        store = self._ipc_store() if self.backend == "ipc" else None
        for index in range(len(plan.buckets)):
            if store is None:  # a fresh buffer: freed as soon as its last tensor is copied out
                bucket = self._empty_bucket(plan, index)
                self._broadcast(bucket)
                self._note(plan, index, bucket, sync, got)
                pairs = _copies(_views(plan, index, bucket))
            else:
                bucket = self._ipc_bucket(store, plan, sync, index)
                self._note(plan, index, bucket, sync, got)
                pairs = list(_copies(_views(plan, index, bucket)))
                self._ack(store, sync, index)
            del bucket
            yield from pairs
            del pairs
        self._verify(got, sync)

    def receive(self, plan: WeightPlan, load: Loader) -> int:
        """Ranks 1..N: receive each bucket and hand its (name, view of the buffer) pairs to `load` before the next
        bucket overwrites nothing (each bucket gets a fresh buffer; under ipc the views are of the sender's memory,
        which goes back to it once `load` returns: `load` copies what it keeps). Returns bytes received."""
        assert self.rank > 0 and self.store is not None, "receive is for ranks 1..N, after connect"
        sync, self.syncs, got = self.syncs, self.syncs + 1, {}
        self._ready(sync)
        if self.backend == "ipc":
            self._receive_ipc(plan, load, sync, got)
        else:
            for index, buffer in enumerate(self._empty_buckets(plan)):
                self._broadcast(buffer)
                self._note(plan, index, buffer, sync, got)
                load(_views(plan, index, buffer))
        self._verify(got, sync)
        return plan.nbytes

    def _empty_buckets(self, plan: WeightPlan) -> Iterator[torch.Tensor]:
        for index in range(len(plan.buckets)):
            yield self._empty_bucket(plan, index)

    def _empty_bucket(self, plan: WeightPlan, index: int) -> torch.Tensor:
        dtype, numel = plan.buckets[index]
        return torch.empty(numel, dtype=_dtype(dtype), device=self.device)

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


# what `share` pickles, per kind of sender memory: the rebuild function and the classes its arguments name
_HANDLE_GLOBALS = {
    "cuda": {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),  # what reduce_tensor names for a CUDA tensor
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
    },
    "cpu": {("forge.weight_group", "_rebuild_cpu")},
}


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles a bucket handle and nothing else: only the globals `share` names for the receiver's kind of memory
    (and, for CUDA, dtypes) resolve; any other global is refused, so a value that passed the HMAC check still runs
    no other code."""

    def __init__(self, data: bytes, kind: str):
        super().__init__(io.BytesIO(data))
        self.allowed = _HANDLE_GLOBALS[kind]

    def find_class(self, module: str, name: str):
        dtype = self.allowed is _HANDLE_GLOBALS["cuda"] and module == "torch" and isinstance(getattr(torch, name, None),
                                                                                            torch.dtype)  # fmt: skip
        if (module, name) in self.allowed or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"weight group (ipc): a handle may not name {module}.{name}")


def load_handle(data: bytes, kind: str = "cpu") -> tuple:
    """The (rebuild, args) that `share` made for a bucket in `kind` memory ("cpu" or "cuda"), from the store's bytes
    (`_HandleUnpickler`: no other code runs).

    >>> import os
    >>> load_handle(pickle.dumps((os.system, ("true",))))
    Traceback (most recent call last):
    _pickle.UnpicklingError: weight group (ipc): a handle may not name posix.system
    """
    return _HandleUnpickler(data, "cuda" if kind == "cuda" else "cpu").load()


def checked_handle(shared: tuple, bucket: tuple[str, int], device: torch.device) -> tuple:
    """`shared` if it is the handle `share` makes for a bucket of the plan's (dtype, numel) on `device`'s kind of
    memory (a CPU shared-memory file, or a CUDA IPC handle of exactly that size), else ValueError: a receiver maps no
    other memory and calls no other rebuild."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (dtype, numel), (fn, args) = bucket, shared
    nbytes = numel * _dtype(dtype).itemsize
    if device.type == "cuda":
        ok = fn is rebuild_cuda_tensor and len(args) > 8 and tuple(args[1]) == (numel,) and args[5] == _dtype(dtype)
        ok = ok and args[8] == nbytes and args[3] == 0
    else:
        handle = args[0] if fn is _rebuild_cpu and len(args) == 3 and isinstance(args[0], tuple) else ()
        ok = len(handle) == 3 and all(isinstance(h, (str, bytes)) for h in handle[:2]) and handle[2] == nbytes
        ok = ok and args[1:] == (dtype, numel)
    if not ok:
        raise ValueError(f"weight group (ipc): a handle that is not the sender's bucket ({dtype} x {numel}): refused")
    return shared


def _rebuild_cpu(handle: tuple, dtype: str, numel: int) -> torch.Tensor:
    manager, filename, size = handle
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, filename, size)
    return torch.empty(0, dtype=_dtype(dtype)).set_(storage, 0, (numel,))


FINGERPRINT_SLICE = 16  # elements read per tensor and sync
FROZEN_SYNC = -1  # the sync number a plan's `frozen` fingerprints are taken at (no sync has that number)


def fingerprint(pairs: Iterable[tuple[str, torch.Tensor]], sync: int,
                dtypes: dict[str, torch.dtype] | None = None) -> dict[str, float]:  # fmt: skip
    """Per tensor, a weighted sum (float64) of a slice of `FINGERPRINT_SLICE` elements at a place that moves with
    the tensor's name and the sync: both ends compute it on the same dtype (what was packed, what arrived), so equal
    tensors give equal numbers, and a tensor scaled, zeroed or shifted in transit almost surely does not. It reads
    16 elements a tensor: its cost is the number of tensors, not their size. `dtypes`: cast each slice to its
    tensor's publish dtype first (a receiver's live fp32 parameters against the bf16 that was sent).

    >>> t = torch.arange(100.0)
    >>> fingerprint([("w", t)], 0) == fingerprint([("w", t.clone())], 0) != fingerprint([("w", t * 1.001)], 0)
    True
    """
    out = {}
    for name, t in pairs:
        flat = t.reshape(-1)
        n = flat.numel()
        k = min(n, FINGERPRINT_SLICE)
        if k == 0:
            out[name] = 0.0
            continue
        start = (zlib.crc32(name.encode()) + sync * 7919) % n
        idx = (start + torch.arange(k, device=flat.device) * max(1, n // k)) % n
        w = torch.arange(1, k + 1, dtype=torch.float64, device=flat.device)
        part = flat[idx] if dtypes is None else flat[idx].to(dtypes[name])
        out[name] = float((part.to(torch.float64) * w).sum())
    return out


def differs(sent: dict[str, float], got: dict[str, float]) -> str:
    """The first tensor whose fingerprint differs (a name, or 'the tensor set'), '' if none."""
    if list(sent) != list(got):
        return "the tensor set"
    return next((repr(k) for k, v in sent.items() if not (v == got[k] or (v != v and got[k] != got[k]))), "")


def _views(plan: WeightPlan, index: int, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Bucket `index`'s tensors as (name, view of `bucket`) pairs, in the plan's order."""
    return [(s.name, bucket[s.offset : s.offset + _numel(s)].view(s.shape)) for s in _in_bucket(plan, index)]


def _copies(pairs: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) pairs as (name, copy) pairs, made one at a time; `pairs` is consumed and each view dropped once
    copied, so the buffer they view is freed as soon as its last tensor was copied out, while the loader may keep any
    copy.

    >>> buf = torch.arange(4.0)
    >>> [(n, t.tolist(), t.data_ptr() == buf.data_ptr()) for n, t in _copies([("a", buf[:2]), ("b", buf[2:])])]
    [('a', [0.0, 1.0], False), ('b', [2.0, 3.0], False)]
    """
    pairs.reverse()
    while pairs:
        name, view = pairs.pop()
        copy = view.clone()
        del view
        yield name, copy


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
