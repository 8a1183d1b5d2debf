import pytest

from weaver.apply import (
    _disjoint_groups,
    accelerate_launch_args,
    concurrency_limits,
    prefect_tags,
    stage_env,
    work_pool_for,
    work_pools,
)
from weaver.errors import PlanError
from weaver.plan import plan, stage_needs
from weaver.pools import Pool

B = 1_000_000_000
CPU_BOX = [Pool("cpu", "cpu", host="box", cpu_cores=2, memory_gib=8)]
CPU = Pool("cpu", "cpu", host="node-a", cpu_cores=16, memory_gib=256, work_pool="wp-cpu")
EIGHT = [CPU, Pool("gpu", "gpu", tuple(range(8)), host="node-a", work_pool="wp-gpu", memory_gib=80)]
TWO_NODES = [
    CPU,
    Pool("gpu-a", "gpu", tuple(range(8)), host="node-a", work_pool="wp-a", memory_gib=80),
    Pool("gpu-b", "gpu", tuple(range(8)), host="node-b", work_pool="wp-b", memory_gib=80),
]


def test_cpu_stage_env_hides_gpus_and_splits_cores_between_processes():
    p = plan(stage_needs(135_000_000, update_processes=2, gpu=False), CPU_BOX)
    assert stage_env(p, "reward", 2) == {
        "OMP_NUM_THREADS": "2",
        "FORGEWEAVE_THREADS": "2",
        "FORGEWEAVE_STAGE": "reward",
        "FORGEWEAVE_POOL": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "ACCELERATE_USE_CPU": "1",
    }
    assert stage_env(p, "update", 2)["OMP_NUM_THREADS"] == "1"  # 2 cores // 2 processes
    assert stage_env(p, "update", 1)["OMP_NUM_THREADS"] == "1"  # never 0


def test_gpu_stage_env_shows_only_its_devices():
    p = plan(stage_needs(4 * B, rollout_replicas=0, update_processes=4, gpu=True), EIGHT)
    update, rollout = stage_env(p, "update", 16), stage_env(p, "rollout", 16)
    assert (update["CUDA_VISIBLE_DEVICES"], rollout["CUDA_VISIBLE_DEVICES"]) == ("0,1,2,3", "4,5,6,7")
    assert update["OMP_NUM_THREADS"] == "4" and "ACCELERATE_USE_CPU" not in update  # 16 cores // 4 processes
    assert stage_env(p, "prep", 16)["CUDA_VISIBLE_DEVICES"] == ""


def test_stage_env_per_host_for_multi_node_update():
    p = plan(stage_needs(4 * B, gpu=True), TWO_NODES)  # update 7 + 7, rollout on node-b GPU 7
    assert stage_env(p, "update", 16, host="node-b")["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6"
    assert stage_env(p, "update", 16, host="node-b")["FORGEWEAVE_POOL"] == "gpu-b"
    with pytest.raises(PlanError, match="^stage 'rollout' has no processes on host 'node-a'; it runs on node-b$"):
        stage_env(p, "rollout", 16, host="node-a")


def test_accelerate_args_on_cpu_avoid_the_single_process_pitfall():
    one = plan(stage_needs(135_000_000, gpu=False), CPU_BOX)
    assert accelerate_launch_args(one) == ["--cpu", "--num_processes", "1", "--num_machines", "1"]
    two = plan(stage_needs(135_000_000, update_processes=2, gpu=False), CPU_BOX)
    # `--cpu --num_processes 2` would run ONE process; --multi_gpu + ACCELERATE_USE_CPU=1 runs two synced ones
    assert accelerate_launch_args(two) == ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    assert stage_env(two, "update", 2)["ACCELERATE_USE_CPU"] == "1"


def test_accelerate_args_on_gpus():
    one = plan(stage_needs(B // 2, gpu=True), [CPU, Pool("gpu", "gpu", (0,), memory_gib=24)])
    assert accelerate_launch_args(one) == ["--num_processes", "1", "--num_machines", "1"]
    eight = plan(stage_needs(B, gpu=True), EIGHT)
    assert accelerate_launch_args(eight) == ["--multi_gpu", "--num_processes", "8", "--num_machines", "1"]


def test_accelerate_args_multi_node():
    p = plan(stage_needs(B, gpu=True), TWO_NODES)
    common = ["--multi_gpu", "--num_processes", "16", "--num_machines", "2", "--machine_rank"]
    tail = ["--main_process_ip", "node-a", "--main_process_port", "29500"]
    assert accelerate_launch_args(p) == [*common, "{machine_rank}", *tail]
    assert accelerate_launch_args(p, machine_rank=1) == [*common, "1", *tail]


def test_prefect_tags_and_work_pools():
    p = plan(stage_needs(B, gpu=True), TWO_NODES)
    assert prefect_tags(p, "update") == ["pool:gpu-a", "pool:gpu-b", "stage:update"]
    assert prefect_tags(p, "reward") == ["pool:cpu", "stage:reward"]
    assert [work_pool_for(p, s) for s in ("prep", "rollout", "update")] == ["wp-cpu", "wp-a", "wp-a"]
    assert work_pools(p) == ["wp-cpu", "wp-a", "wp-b"]
    assert work_pool_for(plan(stage_needs(1000, gpu=False), CPU_BOX), "update") == ""


def test_concurrency_limits_count_groups_that_share_no_device():
    assert concurrency_limits(plan(stage_needs(135_000_000, gpu=False), CPU_BOX)) == {"pool:cpu": 1}
    colocated = plan(stage_needs(B, gpu=True), EIGHT)
    assert concurrency_limits(colocated) == {"pool:cpu": 1, "pool:gpu": 1}
    split = plan(stage_needs(4 * B, gpu=True), EIGHT)  # update 0-6 | rollout + evaluate on 7
    assert concurrency_limits(split) == {"pool:cpu": 1, "pool:gpu": 2}
    assert concurrency_limits(plan(stage_needs(4 * B, gpu=True), TWO_NODES)) == {
        "pool:cpu": 1,
        "pool:gpu-a": 1,
        "pool:gpu-b": 2,
    }


def test_disjoint_groups():
    assert _disjoint_groups([{0, 1}, {1}, {4}]) == 2
    assert _disjoint_groups([{0}, {2}, {1}, {0, 1, 2}]) == 1
    assert _disjoint_groups([]) == 0
