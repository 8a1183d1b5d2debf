"""GPU accounting on Ray (`flows.ray_reserve`): a run's actors hold, through the run's placement group, the GPUs the
plan gives them, see exactly those, and a second run on the same cluster waits, then stops with one line, instead of
sharing one.

A simulated cluster (`ray.cluster_utils.Cluster`): the head offers pool `cpu` (reward), a second node pool `gpu` with
2 logical GPUs (`num_gpus=2`; there is no CUDA here, so torch sees none and runs on the CPU, but Ray accounts for
them and the actors' CUDA_VISIBLE_DEVICES shows what each was given). The plan puts the update rank on GPU 0 and the
rollout replica on GPU 1 (each stage asks for one, and there are two: kept apart). Tested at the actors' start
(`RayStages` built and closed, no step trained). The private-Ray case (two runs each with its own Ray instance on
one host) is the GPU file lock, tested without Ray.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from flows import ray_reserve
from flows.planning import plan_run
from flows.ray_exec import RayStages
from forge.errors import UserError
from forge.presets import tiny
from forge.recipes.grpo import update_micro_batch
from forge.recipes.wiring import prepare_data
from weaver.apply import Bundle

pytestmark = pytest.mark.slow
POOLS = [
    {"name": "gpu", "kind": "gpu", "devices": [0, 1], "memory_gib": 80, "cpu_cores": 2},
    {"name": "cpu", "kind": "cpu", "cpu_cores": 1},
]


@pytest.fixture(scope="module")
def cluster():
    mp = pytest.MonkeyPatch()
    mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the suite hides GPUs; Ray must number the logical ones
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"pool:cpu": 1000}, "include_dashboard": False,
                        "node_ip_address": "127.0.0.1"},
    )  # fmt: skip
    c.add_node(num_cpus=2, num_gpus=2, resources={"pool:gpu": 1000}, node_ip_address="127.0.0.1")
    mp.undo()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def gpu_cfg():
    cfg = tiny()
    cfg.orchestration.execution, cfg.tracking.mlflow = "ray", False
    cfg.pools = [dict(p) for p in POOLS]
    cfg.update.num_processes = cfg.rollout.replicas = 1
    cfg.orchestration.reserve_timeout_s = 3
    return cfg


def start(cfg, run_dir) -> RayStages:
    _, plan = plan_run(cfg)
    prepare_data(cfg, run_dir)
    return RayStages(cfg, run_dir, plan, update_micro_batch)


def test_actors_see_the_planned_gpus_and_a_second_run_stops_with_one_line_instead_of_sharing(cluster, tmp_path, capsys):
    cfg = gpu_cfg()
    plan, _ = plan_run(cfg)
    assert plan.for_stage("update").devices == (0,) and plan.for_stage("rollout").devices == (1,)
    first = start(cfg, tmp_path / "first")
    specs = first.reservation.specs  # update rank 0, rollout replica 0, reward
    try:
        where = first.where()
        assert [w["cuda_visible_devices"] for w in where["update"]] == ["0"]  # the plan's device, Ray's id
        assert [w["cuda_visible_devices"] for w in where["rollout"]] == ["1"]
        assert [w["cuda_visible_devices"] for w in where["reward"]] == [""]  # a cpu process sees none
        assert first.reservation.gpu_ids == {"gpu": ["0", "1"]}  # Ray's own ids for the bundle: the plan's
        assert ray.available_resources().get("GPU", 0) == 0  # both held by the first run
        # CPUs: pool gpu's 2 cores between its 2 processes, pool cpu's 1 core for reward
        bundles = {b.pool: b for b in first.reservation.bundles}
        assert bundles["gpu"].cpus == 2 and bundles["cpu"].cpus == 1 and bundles["gpu"].devices == (0, 1)

        capsys.readouterr()
        t0 = time.monotonic()
        with pytest.raises(UserError) as stop:
            start(cfg, tmp_path / "second")
        line = str(stop.value)
        assert "\n" not in line and "GPUs 0,1 and 2 CPUs of pool 'gpu'" in line, line
        assert "forgeweave:first:" in line and "reserve_timeout_s" in line, line  # who holds them; what to do
        assert time.monotonic() - t0 >= cfg.orchestration.reserve_timeout_s  # it waited first
        notice = [x for x in capsys.readouterr().err.splitlines() if "waiting up to" in x]
        assert len(notice) == 1 and "pool 'gpu'" in notice[0], notice
        assert ray.available_resources().get("GPU", 0) == 0  # still the first run's: nothing shared, nothing lost
        assert [w["cuda_visible_devices"] for w in first.where()["update"]] == ["0"]
    finally:
        first.close()

    # the GPUs are free again (the removal is asynchronous: allowed the timeout): a new reservation gets the same ones
    again = ray_reserve.reserve(specs, "forgeweave:again", timeout_s=30)
    try:
        assert again.gpu_ids == {"gpu": ["0", "1"]}
        assert [s.env["CUDA_VISIBLE_DEVICES"] for s in again.specs] == ["0", "1", ""]
    finally:
        again.close()


def test_a_pool_whose_nodes_have_too_few_gpus_stops_at_once(cluster, tmp_path):
    cfg = gpu_cfg()
    cfg.pools[0]["devices"] = [0, 1, 2]
    cfg.update.num_processes = 2  # 2 ranks + 1 replica: 3 GPUs of pool gpu, whose node has 2
    with pytest.raises(UserError, match=r"pool 'gpu': the plan gives this run 3 GPUs on one node, but its Ray nodes "
                       r"have at most 2: start them with"):  # fmt: skip
        start(cfg, tmp_path / "too-many")


def test_a_teacher_in_a_gpu_pool_of_its_own_sees_that_pools_gpu(cluster, tmp_path, monkeypatch):
    """A gpu pool reserved for the distillation teacher (`stages: [teacher]`, weaver rule 8) on a third node: the
    teacher actor gets that node's GPU, update and rollout keep pool gpu's two. Runs last: its node stays."""
    from forge.models import load_policy
    from tests.rewards.test_teacher import save

    with monkeypatch.context() as mp:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        cluster.add_node(num_cpus=1, num_gpus=1, resources={"pool:distill": 1000}, node_ip_address="127.0.0.1")
    cfg = gpu_cfg()
    cfg.pools.append(
        {"name": "distill", "kind": "gpu", "devices": [0], "memory_gib": 24, "host": "node-t", "stages": ["teacher"]}
    )
    cfg.distill.teacher = save(*load_policy(cfg.model, seed=1), tmp_path / "teacher")
    plan, _ = plan_run(cfg)
    assert (plan.for_stage("teacher").pool, plan.for_stage("teacher").devices) == ("distill", (0,))
    assert plan.for_stage("update").devices == (0,) and plan.for_stage("rollout").devices == (1,)
    run = start(cfg, tmp_path / "run")
    try:
        where = run.where()
        assert run.reservation.gpu_ids == {"gpu": ["0", "1"], "distill": ["0"]}  # Ray's ids, per node
        assert [w["cuda_visible_devices"] for w in where["teacher"]] == ["0"]
        assert [w["cuda_visible_devices"] for w in where["update"] + where["rollout"]] == ["0", "1"]
        assert where["teacher"][0]["node_id"] != where["update"][0]["node_id"]  # on the distill pool's own node
    finally:
        run.close()


def test_private_ray_runs_on_one_host_lock_their_gpus(tmp_path, monkeypatch):
    """Two private Ray instances cannot see each other's placement groups: the second run waits for the first's GPU
    locks, then stops with one line; once the first lets go, it gets them."""
    monkeypatch.setattr(ray_reserve, "LOCKS", tmp_path / "locks")
    bundles = [Bundle("gpu", (0, 1), 0.0, 1)]
    first = ray_reserve._lock(["0", "1"], time.monotonic() + 1, bundles)
    with pytest.raises(UserError) as stop:
        ray_reserve._lock(["1", "2"], time.monotonic() + 0.5, bundles)
    line = str(stop.value)
    assert "\n" not in line and "GPUs 0,1 of pool 'gpu'" in line and "private Ray on this host" in line, line
    third = ray_reserve._lock(["2", "3"], time.monotonic() + 0.5, bundles)  # other GPUs: no wait
    for f in first:
        f.close()
    second = ray_reserve._lock(["0", "1"], time.monotonic() + 0.5, bundles)  # free again
    assert len(second) == 2
    for f in second + third:
        f.close()
