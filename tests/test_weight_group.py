"""forge.weight_group with real processes over gloo on 127.0.0.1: this test process is rank 0 (the trainer),
receivers are spawned processes that save what they receive. Bit-identical tensors after the cast, several syncs
over one group, a group rebuilt after a receiver was SIGKILLed, and the metadata-only plan. The ipc transport
(colocated mode) the same way on the CPU: shared-memory buckets, handles and acks through the store, a dead receiver
named after the group's timeout, a receiver elsewhere refused at connect. A receive that begins after the group's
timeout (queued behind generate calls) still gets its sync. (Unrelated processes, two Ray actors,
share buckets in tests/flows/test_weight_sync_ray.py.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from forge.errors import UserError
from forge.weight_group import WeightGroup, copy_into, make_plan, plan_for

HOST = "127.0.0.1"


def weights(step: int) -> dict[str, torch.Tensor]:
    """A model-like state in send order: fp32 matrices, a bf16 vector, an int64 buffer (not cast)."""
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layer.0.w": torch.randn(16, 16, generator=g),
        "layer.0.b": torch.randn(16, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(8) + step,
        "layer.1.w": torch.randn(16, 33, generator=g),
    }


def expected(step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights(step).items()}


def _receiver(rank: int, world: int, port: int, plan, steps: int, out: str, backend: str = "gloo",
              place: str = "") -> None:  # fmt: skip
    """Receive `steps` syncs and save each; `place`: pretend to be there (ipc's check at connect)."""
    torch.set_num_threads(1)
    if place:
        import forge.weight_group

        forge.weight_group.place = lambda device: place
    group = WeightGroup(rank, world, backend, timeout=timedelta(seconds=60))
    group.connect(HOST, port, local_address=HOST)
    live = _count_buckets(group) if rank == 2 else None
    for step in range(steps):
        got: dict[str, torch.Tensor] = {}
        if rank == 2:  # as a vLLM worker loads: the stream, consumed pair by pair; no more than one bucket alive
            for name, t in group.stream(plan):
                got[name] = t.clone()
                live["max"] = max(live["max"], _alive(live))
        else:
            group.receive(plan, lambda pairs, got=got: got.update({n: t.clone() for n, t in pairs}))
        torch.save(got, Path(out) / f"rank{rank}-step{step}.pt")
    if live is not None:
        Path(out, f"rank{rank}-live.txt").write_text(str(live["max"]))
    group.close()


def _count_buckets(group: WeightGroup) -> dict:
    """Track the receive buffers `group` makes (gloo: `_empty_bucket`); counted as each pair arrives (the loader's
    last tensor of the bucket before is its own to drop)."""
    import weakref

    live: dict = {"refs": [], "max": 0}
    make = group._empty_bucket

    def tracked(plan, index):
        buffer = make(plan, index)
        live["refs"].append(weakref.ref(buffer))
        return buffer

    group._empty_bucket = tracked
    return live


def _alive(live: dict) -> int:
    import gc

    gc.collect()
    return sum(r() is not None for r in live["refs"])


def _start(world: int, port: int, plan, steps: int, out: Path, backend: str = "gloo",
           place: str = "") -> list[mp.Process]:  # fmt: skip
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(r, world, port, plan, steps, str(out), backend, place), daemon=True)
             for r in range(1, world)]  # fmt: skip
    for p in procs:
        p.start()
    return procs


def _host(world: int, timeout_s: float = 60, backend: str = "gloo") -> tuple[WeightGroup, int]:
    group = WeightGroup(0, world, backend, timeout=timedelta(seconds=timeout_s))
    return group, group.host(HOST)


def _shm_files() -> list[str]:
    """This process's shared-memory files (torch's file_system strategy names them torch_<pid>_...)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")]


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_receivers_get_bit_identical_tensors_over_several_syncs(tmp_path, backend):
    dtype = torch.bfloat16
    plan = plan_for(weights(0).items(), dtype, bucket_bytes=1024)  # several buckets: 800 bf16 elements > 1 kB
    assert len(plan.buckets) > 2 and plan.buckets[-1][0] == "bfloat16"
    group, port = _host(3, backend=backend)
    procs = _start(3, port, plan, 3, tmp_path, backend)
    group.connect(HOST, port, local_address=HOST)
    for step in range(3):
        assert group.send(plan, weights(step).items()) == plan.nbytes
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not _shm_files(), "ipc: a bucket outlived its sync"  # each is freed once both receivers acked it
    group.close()
    if backend == "gloo":  # rank 2 streamed (as a vLLM worker's loader does): one receive buffer alive at a time
        assert (tmp_path / "rank2-live.txt").read_text() == "1" and len(plan.buckets) > 2
    for rank in (1, 2):  # rank 1 received bucket by bucket into a loader, rank 2 streamed: the same tensors
        for step in range(3):
            got, want = torch.load(tmp_path / f"rank{rank}-step{step}.pt"), expected(step, dtype)
            assert list(got) == list(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (rank, step, k)


def test_a_group_is_rebuilt_after_a_receiver_is_killed(tmp_path):
    plan = plan_for(weights(0).items(), torch.float32)
    group, port = _host(3, timeout_s=20)
    (tmp_path / "old").mkdir()
    procs = _start(3, port, plan, 10, tmp_path / "old")
    group.connect(HOST, port, local_address=HOST)
    group.send(plan, weights(0).items())
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(timeout=10)
    with pytest.raises(RuntimeError):  # the dead peer breaks the collective (within the group's own timeout)
        for step in range(1, 10):
            group.send(plan, weights(step).items())
    group.close()
    procs[0].join(timeout=30)
    assert procs[0].exitcode != 0  # the surviving receiver's collective failed too
    (tmp_path / "new").mkdir()
    group, port = _host(3)
    procs = _start(3, port, plan, 1, tmp_path / "new")
    group.connect(HOST, port, local_address=HOST)
    group.send(plan, weights(7).items())
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    group.close()
    for rank in (1, 2):
        got = torch.load(tmp_path / "new" / f"rank{rank}-step0.pt")
        assert all(torch.equal(got[k], v) for k, v in expected(7, torch.float32).items())


def test_ipc_a_dead_receiver_is_named_after_the_timeout_and_one_elsewhere_is_refused(tmp_path):
    one = [("w", torch.randn(8, 8))]
    plan = plan_for(one, torch.float32)  # one bucket: rank 1 gets the whole sync
    group, port = _host(3, timeout_s=60, backend="ipc")
    procs = _start(3, port, plan, 1, tmp_path, "ipc")
    group.connect(HOST, port, local_address=HOST)
    group.timeout = timedelta(seconds=3)  # joining took the spawned processes' start-up; the sync gets 3 s
    group.store.wait(["ready/0/2"], timedelta(seconds=30))  # rank 2 has begun the sync (it begins at once)
    os.kill(procs[1].pid, signal.SIGKILL)  # rank 2
    procs[1].join(timeout=10)
    with pytest.raises(RuntimeError, match=r"rank 0 waited 3 s to have bucket 0 of sync 0 acked, no word from rank 2 "):
        group.send(plan, one)
    procs[0].join(timeout=30)
    assert procs[0].exitcode == 0  # rank 1 got its sync: only the dead rank is missing
    group.close()
    group, port = _host(2, timeout_s=30, backend="ipc")
    procs = _start(2, port, plan, 1, tmp_path, "ipc", place="otherhost/boot/GPU-1")
    with pytest.raises(UserError, match=r"^weight group \(ipc\): rank 1 is on otherhost/boot/GPU-1, rank 0 on "):
        group.connect(HOST, port, local_address=HOST)
    procs[0].join(timeout=30)
    assert procs[0].exitcode != 0  # the receiver refused itself too
    group.close()


def _late_receiver(port: int, plan, delay_s: float, out: str) -> None:
    """Rank 1 of 2 with a 2 s group timeout that begins its receive `delay_s` late (as a receive queued behind
    generate calls does under asynchronous GRPO)."""
    import time

    torch.set_num_threads(1)
    group = WeightGroup(1, 2, "gloo", timeout=timedelta(seconds=2))
    group.connect(HOST, port, local_address=HOST)
    time.sleep(delay_s)
    got: dict[str, torch.Tensor] = {}
    group.receive(plan, lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    torch.save(got, Path(out) / "late.pt")


def test_a_receive_that_begins_after_the_groups_timeout_still_gets_the_sync(tmp_path):
    """A send waits for every receiver to begin (`ready_timeout`) before any collective opens, so a receiver
    that starts 4 s late in a group whose timeout is 2 s gets the sync, bit for bit; with the wait left at the
    group's timeout the sender says who never began, in one line."""
    plan = plan_for(weights(0).items(), torch.float32)
    ctx = mp.get_context("spawn")
    for ready_s, ok in ((60, True), (2, False)):
        group = WeightGroup(0, 2, "gloo", timeout=timedelta(seconds=60), ready_timeout=timedelta(seconds=ready_s))
        port = group.host(HOST)
        proc = ctx.Process(target=_late_receiver, args=(port, plan, 4.0, str(tmp_path)), daemon=True)
        proc.start()
        group.connect(HOST, port, local_address=HOST)
        group.timeout = timedelta(seconds=2)  # joining took the process's start-up; each collective gets 2 s now
        if ok:
            assert group.send(plan, weights(0).items()) == plan.nbytes
            proc.join(timeout=30)
            assert proc.exitcode == 0
            got, want = torch.load(tmp_path / "late.pt"), expected(0, torch.float32)
            assert all(torch.equal(got[k], v) for k, v in want.items())
        else:
            with pytest.raises(RuntimeError, match=r"rank 0 waited 2 s to see every receiver begin sync 0, no word "
                                                   r"from rank 1 \(died or hangs\)"):  # fmt: skip
                group.send(plan, weights(0).items())
            proc.kill()
            proc.join(timeout=10)
        group.close()


def test_copy_into_loads_in_place_and_a_tied_head_follows():
    from torch import nn

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    ptr = model[0].weight.data_ptr()
    new = torch.randn(10, 4)
    copy_into(model)([("0.weight", new)])
    assert torch.equal(model[1].weight, new) and model[0].weight.data_ptr() == ptr
    with pytest.raises(KeyError, match="no tensor 'lm_head.weight'"):
        copy_into(model)([("lm_head.weight", new)])


def test_plan_is_metadata_and_bad_input_is_one_line():
    plan = make_plan([("w", torch.float32, (1000, 1000))], torch.bfloat16, bucket_bytes=1 << 20)
    assert plan.buckets == (("bfloat16", 1_000_000),)  # one tensor larger than a bucket travels alone
    assert plan.nbytes == 2_000_000
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        make_plan([], torch.float32, bucket_bytes=0)
    with pytest.raises(ValueError, match="needs world >= 2"):
        WeightGroup(0, 1)
    with pytest.raises(ValueError, match="backend must be gloo, nccl or ipc"):
        WeightGroup(0, 2, backend="mpi")


def test_trainer_publishes_each_weight_once_and_a_copy_matches_it():
    """What update rank 0 sends (`Trainer.publish_tensors`): its live tensors, tied copies once, in the order and
    shapes of `publish_shapes` (the plan is made from those without touching the tensors). Loaded with
    `copy_into` into another copy of the policy, the copy's whole state equals the trainer's."""
    from forge.compose import trainer_worker as TrainerWorker
    from forge.models import load_policy
    from forge.presets import tiny
    from forge.recipes.grpo import update_micro_batch

    cfg = tiny()
    trainer = TrainerWorker(cfg, micro_update=update_micro_batch).trainer
    sent = list(trainer.publish_tensors())
    assert [(n, t.dtype, tuple(t.shape)) for n, t in sent] == trainer.publish_shapes()
    every = trainer.unwrapped.state_dict()
    tied = len(every) - len(sent)
    assert tied == int(trainer.unwrapped.config.tie_word_embeddings)  # the LM head, when tied to the embedding
    assert all(t.data_ptr() == every[n].data_ptr() for n, t in sent)  # no host copy
    copy, _ = load_policy(cfg.model, seed=cfg.seed + 1)
    copy_into(copy)(sent)
    assert all(torch.equal(v, every[k]) for k, v in copy.state_dict().items())


def test_an_ipc_handle_loads_only_the_rebuild_globals():
    """The store's bytes are unpickled with a whitelist per kind of memory: a CUDA handle's shape (reduce_tensor's
    globals) loads on a CUDA receiver and is refused on a CPU one; a payload naming any other callable is refused
    before it runs."""
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from forge.weight_group import load_handle

    cuda_like = (rebuild_cuda_tensor, (torch.Tensor, torch.Size([3]), (1,), 0, torch.UntypedStorage, torch.bfloat16, 0,
                                       b"h", 6, 0, False, b"r", 0, b"e", True))  # fmt: skip
    assert load_handle(pickle.dumps(cuda_like), "cuda") == cuda_like
    with pytest.raises(pickle.UnpicklingError, match="may not name torch.multiprocessing.reductions.rebuild_cuda"):
        load_handle(pickle.dumps(cuda_like), "cpu")
    for kind in ("cpu", "cuda"):
        with pytest.raises(pickle.UnpicklingError, match="a handle may not name builtins.eval"):
            load_handle(pickle.dumps((eval, ("1",))), kind)


# ---------------------------------------------------------------- trust: the secret, the bound store, signed values


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket of this host listens on at `port` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def _impostor(world: int, port: int, out: str) -> None:
    """A process that joins with another secret: it must be refused, and must refuse rank 0 in turn."""
    group = WeightGroup(1, world, "ipc", timeout=timedelta(seconds=20), secret=b"not the run's secret")
    try:
        group.connect(HOST, port)
    except UserError as e:
        Path(out, "impostor.txt").write_text(str(e))


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_the_store_listens_only_where_it_is_hosted(backend):
    group = WeightGroup(0, 2, backend, timeout=timedelta(seconds=5))
    port = group.host(HOST)
    assert _listening(port) == {"0100007F"}  # 127.0.0.1 only; torch's own store would listen on every interface
    group.close()


def test_a_member_without_the_runs_secret_is_refused_both_ways(tmp_path):
    group, port = _host(2, timeout_s=20, backend="ipc")
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_impostor, args=(2, port, str(tmp_path)), daemon=True)
    proc.start()
    with pytest.raises(UserError, match=r"rank 1 does not hold this run's secret \(\$FORGEWEAVE_WEIGHT_SECRET\)"):
        group.connect(HOST, port)
    proc.join(timeout=60)
    assert "rank 0 does not hold this run's secret" in (tmp_path / "impostor.txt").read_text()
    group.close()


def test_ipc_values_are_signed_and_a_handle_must_be_the_senders_bucket():
    from forge.weight_group import _rebuild_cpu, checked_handle, mac, share, shareable

    group = WeightGroup(0, 2, "ipc", timeout=timedelta(seconds=5), secret=b"k")
    group.store = torch.distributed.HashStore()
    group._put(group.store, "0/0", b"payload")
    assert group._get_signed(group.store, "0/0") == b"payload"
    group.store.set("0/1", mac(b"other", "0/1", b"x") + b"x")  # written by a process without the secret
    with pytest.raises(RuntimeError, match="not signed with this run's secret"):
        group._get_signed(group.store, "0/1")
    group.store.set("0/2", mac(b"k", "0/0", b"payload") + b"payload")  # a signed value replayed under another key
    with pytest.raises(RuntimeError, match="under '0/2' is not signed"):
        group._get_signed(group.store, "0/2")
    bucket = shareable(6, torch.bfloat16, torch.device("cpu"))
    handle = share(bucket)
    assert checked_handle(handle, ("bfloat16", 6), torch.device("cpu")) is handle
    (manager, name, size), dtype, numel = handle[1]
    bad = [("bfloat16", 7), ("float32", 6)]  # another size or dtype than the plan's bucket
    for b in bad:
        with pytest.raises(ValueError, match="not the sender's bucket"):
            checked_handle(handle, b, torch.device("cpu"))
    for args in [((manager, name, 1 << 40), dtype, numel), ((manager, name, size), dtype, 1 << 40)]:  # map 1 TB?
        with pytest.raises(ValueError, match="not the sender's bucket"):
            checked_handle((_rebuild_cpu, args), ("bfloat16", 6), torch.device("cpu"))
    with pytest.raises(ValueError, match="not the sender's bucket"):  # a CUDA handle where the sender is on the CPU
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        checked_handle((rebuild_cuda_tensor, handle[1]), ("bfloat16", 6), torch.device("cpu"))


# ---------------------------------------------------------------- integrity: what arrived is what was sent


def _corrupting_receiver(world: int, port: int, plan, out: str, backend: str) -> None:
    """Rank 1, whose second bucket of the sync is scaled by 2 after it arrived (a fault in transit)."""
    group = WeightGroup(1, world, backend, timeout=timedelta(seconds=30))
    group.connect(HOST, port, local_address=HOST)
    if backend == "ipc":
        real_bucket = group._ipc_bucket
        group._ipc_bucket = lambda store, plan, sync, index: real_bucket(store, plan, sync, index) * (2 if index else 1)
    else:
        real, seen = group._broadcast, []

        def corrupt(buffer):
            real(buffer)
            seen.append(1)
            if len(seen) == 2:
                buffer.mul_(2)

        group._broadcast = corrupt
    try:
        group.receive(plan, lambda pairs: None)
    except RuntimeError as e:
        Path(out, "caught.txt").write_text(str(e))


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_tensor_corrupted_in_transit_stops_the_sync_naming_it(tmp_path, backend):
    plan = plan_for(weights(0).items(), torch.bfloat16, bucket_bytes=1024)
    second = [s.name for s in plan.tensors if s.bucket == 1]
    group, port = _host(2, backend=backend)
    proc = mp.get_context("spawn").Process(target=_corrupting_receiver, args=(2, port, plan, str(tmp_path), backend),
                                           daemon=True)  # fmt: skip
    proc.start()
    group.connect(HOST, port, local_address=HOST)
    group.send(plan, weights(0).items())
    proc.join(timeout=60)
    caught = (tmp_path / "caught.txt").read_text()
    assert caught.startswith(f"weight group: rank 1: sync 0: {second[0]!r} arrived other than rank 0 sent it "
                             "(corrupted in transit)"), caught  # fmt: skip
    group.close()


def test_a_load_that_did_not_take_is_named():
    """`check_loaded`: the engine's live tensors (fp32) against what rank 0 sent (bf16 fingerprints)."""
    from forge.weight_group import fingerprint

    plan = plan_for(weights(3).items(), torch.bfloat16)
    group = WeightGroup(1, 2, "gloo", secret=b"k")
    group.syncs, group.sent = 1, fingerprint(expected(3, torch.bfloat16).items(), 0)
    live = {k: v.float() if v.is_floating_point() else v for k, v in expected(3, torch.bfloat16).items()}
    group.check_loaded(plan, live)  # fp32 copies of what was sent: equal after the cast back
    stale = {**live, "layer.0.w": live["layer.0.w"] + 1}  # the old weights still in place
    with pytest.raises(RuntimeError, match="after sync 0 the engine's 'layer.0.w' is not what rank 0 sent"):
        group.check_loaded(plan, stale)
    group.check = False  # rollout.weight_check=false
    group.check_loaded(plan, stale)
