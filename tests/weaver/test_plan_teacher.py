"""Rule 8 of weaver/plan.py: the distillation teacher is one process placed beside update (where the reference model
lives), or in a cpu pool reserved for it; plans without a teacher are unchanged (tests/weaver/test_plan.py)."""

import pytest

from weaver.errors import PlanError
from weaver.plan import StageNeed, plan, stage_needs
from weaver.pools import Pool, pools_from_dicts

B = 1_000_000_000
CPU_BOX = Pool("cpu", "cpu", host="box", cpu_cores=2, memory_gib=8)
# Hand-worked (GiB = 2**30 bytes): teacher = params * 4 B (fp32) / 2**30 + 1
#   135M: 0.50 + 1 = 1.50    1B: 3.73 + 1 = 4.73    4B: 14.90 + 1 = 15.90    6B: 22.35 + 1 = 23.35
#   update 0.5B on GPU: 10.31, rollout 0.5B: 2.86 (test_plan.py); update 135M on CPU: 3.51


def gpus(n: int, memory_gib: float) -> Pool:
    return Pool("gpu", "gpu", tuple(range(n)), host="node-a", cpu_cores=16, memory_gib=memory_gib)


def test_stage_needs_adds_a_teacher_of_updates_kind_only_when_asked():
    assert [n.name for n in stage_needs(B, gpu=True)] == ["prep", "rollout", "reward", "update", "evaluate"]
    needs = {n.name: n for n in stage_needs(B, gpu=True, teacher_params=B)}
    assert needs["teacher"] == StageNeed("teacher", "gpu", 1, 1, 4.73, beside="update")
    cpu = {n.name: n for n in stage_needs(135_000_000, gpu=False, teacher_params=135_000_000)}
    assert cpu["teacher"] == StageNeed("teacher", "cpu", 1, 1, 1.5, beside="update")


def test_a_cpu_teacher_goes_in_updates_pool_even_one_reserved_for_update():
    p = plan(stage_needs(135_000_000, gpu=False, teacher_params=135_000_000), [CPU_BOX])  # 3.51 + 1.50 <= 8
    teacher = p.for_stage("teacher")
    assert (teacher.kind, teacher.pool, teacher.processes) == ("cpu", "cpu", 1)
    assert teacher.reason == "beside update in its pool: 1 process on 2 cores"
    assert p.for_stage("update").colocated_with[-1] == "teacher"
    pools = pools_from_dicts([{"name": "gen", "kind": "cpu", "stages": ["prep", "rollout", "reward", "evaluate"]},
                              {"name": "train", "kind": "cpu", "cpu_cores": 2, "stages": ["update"]}])  # fmt: skip
    p = plan(stage_needs(1_000_000, gpu=False, teacher_params=1_000_000), pools)
    assert p.for_stage("teacher").pool == p.for_stage("update").pool == "train"


def test_a_cpu_teacher_that_does_not_fit_beside_update_takes_another_pool():
    big = Pool("big", "cpu", host="node-b", cpu_cores=16, memory_gib=64)
    p = plan(stage_needs(135_000_000, gpu=False, teacher_params=B), [CPU_BOX, big])  # 3.51 + 4.73 > 8
    assert p.for_stage("update").pool == "cpu" and p.for_stage("teacher").pool == "big"
    assert p.for_stage("teacher").reason == (
        "update 3.5 GiB + teacher 4.7 GiB exceed pool cpu's RAM; 1 process on 16 cores"
    )


def test_a_pool_reserved_for_the_teacher_takes_it_on_cpu_and_gpu_clusters():
    own = Pool("distill", "cpu", host="node-t", cpu_cores=8, stages=("teacher",))
    for needs, pools in [(stage_needs(135_000_000, gpu=False, teacher_params=B), [CPU_BOX, own]),
                         (stage_needs(B // 2, gpu=True, teacher_params=B), [CPU_BOX, own, gpus(1, 24)])]:  # fmt: skip
        teacher = plan(needs, pools).for_stage("teacher")
        assert (teacher.kind, teacher.pool, teacher.reason) == ("cpu", "distill", "its own pool; 1 process on 8 cores")


def test_a_gpu_teacher_shares_updates_first_gpu_when_it_has_room():
    p = plan(stage_needs(B // 2, gpu=True, teacher_params=B), [CPU_BOX, gpus(1, 24)])  # 24 - 10.31 - 2.86 = 10.83
    teacher = p.for_stage("teacher")
    assert (teacher.kind, teacher.pool, teacher.devices) == ("gpu", "gpu", (0,))
    assert teacher.reason == "beside update on its GPU: 4.7 GiB of 10.8 GiB left"
    assert teacher.colocated_with == ("rollout", "update", "evaluate")


def test_a_gpu_teacher_takes_the_gpu_with_most_room_else_a_one_line_error():
    needs = stage_needs(B // 2, gpu=True, update_processes=1, rollout_replicas=1, teacher_params=4 * B)
    p = plan(needs, [CPU_BOX, gpus(2, 24)])  # update alone on GPU 0 (13.69 left), rollout on GPU 1 (21.14 left)
    assert p.for_stage("update").devices == (0,) and p.for_stage("teacher").devices == (1,)
    assert p.for_stage("teacher").reason == "no room beside update; GPU with room: 15.9 GiB of 21.1 GiB left"
    needs = stage_needs(B // 2, gpu=True, update_processes=1, rollout_replicas=1, teacher_params=6 * B)
    with pytest.raises(PlanError, match=r"^teacher needs 23.4 GiB on one GPU; the most any GPU has left beside the "
                                        r"other GPU stages is 21.1 GiB \(gpu: 2 x 24 GiB\): declare a pool "
                                        r"\(cpu or gpu\) with stages: \[teacher\]$") as e:  # fmt: skip
        plan(needs, [CPU_BOX, gpus(2, 24)])
    assert e.value.stage == "teacher"  # flows.planning.make_plan names distill.teacher's directory in its line


def test_update_gives_up_a_gpu_for_a_teacher_no_gpu_has_room_for():
    # 4 x 24 GiB: update (10.31) takes all 4, rollout (2.86) beside it on GPU 0 -> 10.83 / 13.69 left: no room for a
    # 4B teacher (15.90). Update on 3 GPUs leaves GPU 3 whole (24 >= 15.90).
    needs = stage_needs(B // 2, gpu=True, teacher_params=4 * B)
    p = plan(needs, [CPU_BOX, gpus(4, 24)])
    assert p.for_stage("update").devices == (0, 1, 2) and p.for_stage("teacher").devices == (3,)
    assert p.for_stage("update").reason.endswith("; 3 GPUs, not 4: room for teacher")
    assert plan(stage_needs(B // 2, gpu=True), [CPU_BOX, gpus(4, 24)]).for_stage("update").devices == (0, 1, 2, 3)
    # update asks for exactly 4: it cannot give one up, so the line stays
    with pytest.raises(PlanError, match=r"^teacher needs 15.9 GiB on one GPU"):
        plan(stage_needs(B // 2, gpu=True, update_processes=4, teacher_params=4 * B), [CPU_BOX, gpus(4, 24)])


def test_a_gpu_pool_reserved_for_the_teacher_is_its_alone():
    own = Pool("distill", "gpu", (0, 1), host="node-t", cpu_cores=8, memory_gib=24, stages=("teacher",))
    small = Pool("tiny", "gpu", (0,), host="node-s", cpu_cores=4, memory_gib=12, stages=("teacher",))
    # 6B teacher: 23.35 GiB; update (10.31) and rollout (2.86) of 0.5B share node-a's one GPU, never the reserved ones
    p = plan(stage_needs(B // 2, gpu=True, teacher_params=6 * B), [CPU_BOX, small, gpus(1, 24), own])
    teacher = p.for_stage("teacher")
    assert (teacher.kind, teacher.pool, teacher.host, teacher.devices) == ("gpu", "distill", "node-t", (0,))
    assert teacher.reason == "its own gpu pool; 23.4 GiB of 24 GiB"
    assert teacher.colocated_with == ()
    assert {p.for_stage(s).pool for s in ("update", "rollout", "evaluate")} == {"gpu"}
    with pytest.raises(PlanError, match=r"^teacher needs 23.4 GiB on one GPU; the gpu pools reserved for it have "
                                        r"tiny: 1 x 12 GiB: give them GPUs with more memory, or drop teacher from "
                                        r"their stages$"):  # fmt: skip
        plan(stage_needs(B // 2, gpu=True, teacher_params=6 * B), [CPU_BOX, small, gpus(1, 24)])


def test_a_gpu_pool_is_reserved_for_the_teacher_only():
    with pytest.raises(PlanError, match=r"^pools\[0\]\.stages: a gpu pool is reserved only for teacher; the other "
                                        r"GPU stages share the unreserved gpu pools"):  # fmt: skip
        pools_from_dicts([{"name": "g", "kind": "gpu", "devices": [0], "memory_gib": 80, "stages": ["rollout"]}])


def test_beside_must_name_a_stage_that_runs_itself():
    with pytest.raises(PlanError, match="stage 'teacher': beside='nowhere' must name another planned stage"):
        plan([StageNeed("update", "cpu"), StageNeed("teacher", "cpu", beside="nowhere")], [CPU_BOX])
