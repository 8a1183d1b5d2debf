"""weaver.apply: the plan as the processes the execution layer starts (Ray actors)."""

import pytest

from weaver.apply import (
    ActorSpec,
    WeightRoutes,
    actor_specs,
    placement_bundles,
    ray_pool_cpus,
    weight_transport,
    with_gpu_ids,
    with_ray_cpus,
)
from weaver.errors import PlanError
from weaver.plan import plan, stage_needs
from weaver.pools import Pool

B = 1_000_000_000
CPU_BOX = [Pool("cpu", "cpu", host="box", cpu_cores=2, memory_gib=8)]
CPU = Pool("cpu", "cpu", host="node-a", cpu_cores=16, memory_gib=256)
EIGHT = [CPU, Pool("gpu", "gpu", tuple(range(8)), host="node-a", memory_gib=80)]
TWO_NODES = [
    CPU,
    Pool("gpu-a", "gpu", tuple(range(8)), host="node-a", memory_gib=80),
    Pool("gpu-b", "gpu", tuple(range(8)), host="node-b", memory_gib=80),
]
CORES = {"cpu": 16, "gpu": 16, "gpu-a": 16, "gpu-b": 16}
POOLS = {"pool:cpu": 1000.0, "pool:gpu": 1000.0}  # a node offering both pools


def test_cpu_processes_hide_gpus_and_split_the_pools_cores():
    p = plan(stage_needs(135_000_000, update_processes=2, gpu=False), CPU_BOX)
    (reward,) = actor_specs(p, "reward", {"cpu": 2})
    assert reward.env == {
        "OMP_NUM_THREADS": "2",
        "FORGEWEAVE_THREADS": "2",
        "FORGEWEAVE_STAGE": "reward",
        "FORGEWEAVE_POOL": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "ACCELERATE_USE_CPU": "1",  # Accelerate's CPU mode for every process
    }
    ranks = actor_specs(p, "update", {"cpu": 2})
    assert [r.index for r in ranks] == [0, 1] and {r.env["OMP_NUM_THREADS"] for r in ranks} == {"1"}  # 2 // 2
    assert actor_specs(p, "update", {"cpu": 1})[0].env["OMP_NUM_THREADS"] == "1"  # never 0
    assert ranks[0].resources == {"pool:cpu": 0.001} and ranks[0].devices == ()


def test_gpu_ranks_each_see_their_own_device():
    p = plan(stage_needs(4 * B, rollout_replicas=0, update_processes=4, gpu=True), EIGHT)
    ranks, rollout = actor_specs(p, "update", CORES), actor_specs(p, "rollout", CORES)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["0", "1", "2", "3"]
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in rollout] == ["4", "5", "6", "7"]
    assert ranks[0].env["OMP_NUM_THREADS"] == "4" and "ACCELERATE_USE_CPU" not in ranks[0].env  # 16 cores // 4
    assert actor_specs(p, "prep", CORES)[0].env["CUDA_VISIBLE_DEVICES"] == ""


def test_tensor_parallel_replicas_take_blocks_of_devices():
    p = plan(stage_needs(4 * B, rollout_replicas=2, rollout_tp=2, update_processes=4, gpu=True), EIGHT)
    rollout = actor_specs(p, "rollout", CORES, per_process_devices=2)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in rollout] == ["4,5", "6,7"] and [r.index for r in rollout] == [0, 1]
    with pytest.raises(PlanError, match="3 devices per process do not divide"):
        actor_specs(p, "rollout", CORES, per_process_devices=3)


def test_multi_node_update_ranks_follow_the_placements_rank_0_first():
    p = plan(stage_needs(4 * B, gpu=True), TWO_NODES)  # update 7 + 7, rollout on node-b GPU 7
    ranks = actor_specs(p, "update", CORES)
    assert len(ranks) == 14 and [r.index for r in ranks] == list(range(14))
    assert {r.host for r in ranks[:7]} == {"node-a"} and {r.host for r in ranks[7:]} == {"node-b"}
    assert ranks[7].env["CUDA_VISIBLE_DEVICES"] == "0" and ranks[7].resources == {"pool:gpu-b": 0.001}
    assert [(r.host, r.devices) for r in actor_specs(p, "rollout", CORES)] == [("node-b", (7,))]


def _run_specs(p, tp: int = 1) -> list:
    """Every process of a run, as flows.ray_exec starts them: update ranks, rollout replicas, the reward worker."""
    return [*actor_specs(p, "update", CORES), *actor_specs(p, "rollout", CORES, per_process_devices=tp),
            *actor_specs(p, "reward", CORES)]  # fmt: skip


def test_colocated_stages_share_one_gpu_bundle_and_its_gpus_map_in_the_plans_order():
    """Update (4 DDP ranks) and 2 tensor-parallel engines on the same 4 GPUs (they fit together): one bundle holds
    the 4 GPUs for all 6 processes, with their CPU shares; Ray's ids for it map onto the plan's devices in order."""
    four = [CPU, Pool("gpu", "gpu", (0, 1, 2, 3), host="node-a", memory_gib=80)]
    p = plan(stage_needs(B // 2, rollout_replicas=2, rollout_tp=2, update_processes=4, gpu=True), four)
    assert "update" in p.for_stage("rollout").colocated_with
    specs = with_ray_cpus(_run_specs(p, tp=2), ray_pool_cpus({"cpu": 16, "gpu": 16}, [{"CPU": 32.0, **POOLS}]))
    assert [s.cpus for s in specs] == [2.6666] * 6 + [16.0]  # pool gpu's 16 CPUs over 6; reward has pool cpu's
    bundles, index = placement_bundles(specs)
    assert [(b.pool, b.devices, b.processes) for b in bundles] == [("gpu", (0, 1, 2, 3), 6), ("cpu", (), 1)]
    assert index == [0] * 6 + [1] and bundles[0].resources["GPU"] == 4 and bundles[0].cpus == pytest.approx(15.9996)
    ids = dict(zip(bundles[0].devices, ["4", "5", "6", "7"], strict=True))  # Ray reserved the node's GPUs 4-7
    seen = [with_gpu_ids(s, ids).env["CUDA_VISIBLE_DEVICES"] for s in specs]
    assert seen == ["4", "5", "6", "7", "4,5", "6,7", ""]


def test_weight_transport_is_ipc_only_where_every_engine_shares_an_update_ranks_gpu():
    """One GPU: the plan colocates update and rollout on it, so auto picks CUDA IPC; two GPUs with 2 update ranks and
    2 replicas colocated: one ipc group per GPU, each rank feeding the replica on its own GPU; engines on GPUs of
    their own get the broadcast group; a mix of the two, ipc asked for with an engine elsewhere, or a colocated
    tensor-parallel engine (its workers span several GPUs: not built) is one line."""
    one = [CPU, Pool("gpu", "gpu", (0,), host="node-a", memory_gib=140)]
    p = plan(stage_needs(B // 2, gpu=True), one)
    senders, receivers = actor_specs(p, "update", CORES), actor_specs(p, "rollout", CORES)
    assert receivers[0].devices == senders[0].devices == (0,)
    assert weight_transport("auto", senders, receivers) == WeightRoutes("ipc", {0: (0,)})
    with pytest.raises(
        PlanError,
        match=r"^rollout.weight_transport=group: rollout replicas \[0\] share update rank "
        r"0's GPU, where NCCL refuses two ranks of one group: set it to auto or ipc$",
    ):
        weight_transport("group", senders, receivers)
    two = [CPU, Pool("gpu", "gpu", (0, 1), host="node-a", memory_gib=140)]
    p = plan(stage_needs(B // 2, rollout_replicas=2, update_processes=2, gpu=True), two)
    senders, receivers = actor_specs(p, "update", CORES), actor_specs(p, "rollout", CORES)
    assert [s.devices for s in senders] == [r.devices for r in receivers] == [(0,), (1,)]
    assert weight_transport("auto", senders, receivers) == WeightRoutes("ipc", {0: (0,), 1: (1,)})
    assert weight_transport("ipc", senders, receivers[::-1]).groups == {0: (1,), 1: (0,)}  # by GPU, not by index
    p = plan(stage_needs(B // 2, update_processes=2, gpu=True, rollout_tp=2), two)
    tp2 = actor_specs(p, "rollout", CORES, per_process_devices=2)
    assert tp2[0].devices == (0, 1)
    for setting in ("auto", "ipc"):
        with pytest.raises(PlanError, match=r"^rollout.weight_transport: rollout replicas \[0\] are tensor-parallel"):
            weight_transport(setting, senders, tp2)
    p = plan(stage_needs(4 * B, rollout_replicas=0, update_processes=4, gpu=True), EIGHT)
    senders, receivers = actor_specs(p, "update", CORES), actor_specs(p, "rollout", CORES)
    assert weight_transport("auto", senders, receivers) == WeightRoutes("group", {0: tuple(range(len(receivers)))})
    with pytest.raises(PlanError, match=r"^rollout.weight_transport=ipc needs every rollout replica on the GPU of an"):
        weight_transport("ipc", senders, receivers)
    here, there = ActorSpec("rollout", 0, "gpu", "node-a", (1,)), ActorSpec("rollout", 1, "gpu", "node-a", (5,))
    ranks = [ActorSpec("update", r, "gpu", "node-a", (r,)) for r in range(2)]
    with pytest.raises(PlanError, match=r"replicas \[0\] share an update rank's GPU and the others do not"):
        weight_transport("auto", ranks, [here, there])
    cpu = [ActorSpec("update", r, "cpu", "box", ()) for r in range(2)]
    gen = [ActorSpec("rollout", i, "cpu", "box", ()) for i in range(3)]
    assert weight_transport("ipc", cpu, gen) == WeightRoutes("ipc", {0: (0, 2), 1: (1,)})  # shared memory: i % ranks
    assert weight_transport("auto", cpu, gen).transport == "group"


def test_ray_cpu_asks_fit_the_nodes_even_where_pools_declare_more_cores():
    two = ray_pool_cpus({"cpu": 16, "gpu": 16}, [{"CPU": 8.0, **POOLS}])  # one 8-CPU node offers both pools
    assert two == {"cpu": 4.0, "gpu": 4.0}
    split = ray_pool_cpus({"cpu": 16, "gpu": 16}, [{"CPU": 8.0, "pool:cpu": 1.0}, {"CPU": 32.0, "pool:gpu": 1.0}])
    assert split == {"cpu": 8.0, "gpu": 16.0}
    assert ray_pool_cpus({"gpu": 4}, [{"CPU": 8.0, "pool:cpu": 1.0}]) == {"gpu": 0.0}  # no node: nothing to ask
