"""weaver.apply: the plan as the processes the execution layer starts (Ray actors)."""

import pytest

from weaver.apply import actor_specs
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
