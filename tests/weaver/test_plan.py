import ast
import json
from pathlib import Path

import pytest

import weaver
from weaver.errors import PlanError
from weaver.plan import Plan, StageNeed, plan, stage_needs
from weaver.pools import Pool, pools_from_dicts

CPU_BOX = Pool("cpu", "cpu", host="box", cpu_cores=2, memory_gib=8)
CPU = Pool("cpu", "cpu", host="node-a", cpu_cores=16, memory_gib=256)


def gpus(n: int, memory_gib: float, name: str = "gpu", host: str = "node-a", work_pool: str = "") -> Pool:
    return Pool(name, "gpu", tuple(range(n)), host=host, work_pool=work_pool, cpu_cores=16, memory_gib=memory_gib)


# Hand-worked memory estimates (GiB = 2**30 bytes):
#   update  = params * 16 B * 1.25 / 2**30 + 1        rollout (GPU) = params * 2 B * 2 / 2**30 + 1
#   0.5B: update  9.31 + 1 = 10.31   rollout  1.86 + 1 =  2.86   together 13.2
#   3B:   update 55.88 + 1 = 56.88   rollout 11.18 + 1 = 12.18   together 69.1  <= 80: colocate
#   4B:   update 74.51 + 1 = 75.51   rollout 14.90 + 1 = 15.90   together 91.4  >  80: split
B = 1_000_000_000


def test_stage_needs_estimates():
    needs = {n.name: n for n in stage_needs(4 * B, gpu=True)}
    assert [*needs] == ["prep", "rollout", "reward", "update", "evaluate"]
    assert needs["update"] == StageNeed("update", "gpu", 1, 0, 75.51)
    assert needs["rollout"] == StageNeed("rollout", "gpu", 1, 1, 15.9)
    assert needs["evaluate"].runs_in == "rollout"
    cpu = {n.name: n for n in stage_needs(135_000_000, update_processes=2, rollout_replicas=0, gpu=False)}
    # 135M * 16 * 1.25 / 2**30 + 1 = 3.51; rollout fp32: 135M * 4 * 2 / 2**30 + 1 = 2.01
    assert cpu["update"] == StageNeed("update", "cpu", 2, 2, 3.51)
    assert cpu["rollout"] == StageNeed("rollout", "cpu", 1, 1, 2.01)
    with pytest.raises(PlanError, match="model_params must be > 0"):
        stage_needs(0, gpu=False)


def test_one_cpu_box_runs_everything_on_the_cpu_pool():
    p = plan(stage_needs(135_000_000, gpu=False), [CPU_BOX])
    for a in p.assignments:
        assert (a.kind, a.pool, a.host, a.processes, a.devices, a.work_pool) == ("cpu", "cpu", "box", 1, (), "")
    assert p.for_stage("update").colocated_with == ("prep", "rollout", "reward", "evaluate")
    assert p.for_stage("evaluate").reason == "runs in rollout's processes: no extra memory"


def test_cpu_update_processes_are_capped_by_cores():
    p = plan(stage_needs(135_000_000, update_processes=2, gpu=False), [CPU_BOX])
    assert p.for_stage("update").processes == 2
    with pytest.raises(PlanError, match="^update needs 3 cores and 3.5 GiB RAM; pools have cpu: 2 cores, 8 GiB$"):
        plan(stage_needs(135_000_000, update_processes=3, gpu=False), [CPU_BOX])


def test_one_gpu_update_and_rollout_share_it():
    p = plan(stage_needs(B // 2, gpu=True), [CPU, gpus(1, 24)])
    update, rollout, evaluate = p.for_stage("update"), p.for_stage("rollout"), p.for_stage("evaluate")
    assert update.devices == rollout.devices == evaluate.devices == (0,)
    assert update.colocated_with == ("rollout", "evaluate")
    assert update.reason == "shares GPUs: update 10.3 GiB + rollout 2.9 GiB fit in 24 GiB per GPU"
    assert [p.for_stage(s).pool for s in ("prep", "reward")] == ["cpu", "cpu"]


def test_eight_gpus_colocate_when_both_fit():
    p = plan(stage_needs(3 * B, rollout_replicas=0, gpu=True), [CPU, gpus(8, 80)])
    update, rollout = p.for_stage("update"), p.for_stage("rollout")
    assert update.devices == rollout.devices == tuple(range(8))
    assert update.processes == rollout.processes == 8
    assert "rollout" in update.colocated_with
    assert update.reason == "shares GPUs: update 56.9 GiB + rollout 12.2 GiB fit in 80 GiB per GPU"


def test_eight_gpus_split_when_the_model_is_too_large_to_colocate():
    # rule 4: rollout takes its minimum (1) from the last device, update the other 7
    p = plan(stage_needs(4 * B, gpu=True), [CPU, gpus(8, 80)])
    update, rollout = p.for_stage("update"), p.for_stage("rollout")
    assert (update.devices, rollout.devices) == ((0, 1, 2, 3, 4, 5, 6), (7,))
    assert update.colocated_with == () and rollout.colocated_with == ("evaluate",)
    assert rollout.reason == "own GPUs (split): update 75.5 GiB + rollout 15.9 GiB exceed 80 GiB per GPU"
    # update capped at 4 processes: the free devices go to rollout (max 0 = as many as available) -> 4 + 4
    p = plan(stage_needs(4 * B, rollout_replicas=0, update_processes=4, gpu=True), [CPU, gpus(8, 80)])
    assert (p.for_stage("update").devices, p.for_stage("rollout").devices) == ((0, 1, 2, 3), (4, 5, 6, 7))
    p = plan(stage_needs(4 * B, rollout_replicas=2, gpu=True), [CPU, gpus(8, 80)])
    assert (p.for_stage("update").processes, p.for_stage("rollout").devices) == (6, (6, 7))


def test_fixed_counts_that_fit_side_by_side_are_kept_apart():
    p = plan(stage_needs(B, rollout_replicas=2, update_processes=4, gpu=True), [CPU, gpus(8, 80)])
    assert (p.for_stage("update").devices, p.for_stage("rollout").devices) == ((0, 1, 2, 3), (6, 7))
    assert p.for_stage("update").reason.startswith("own GPUs: enough devices")


def test_two_nodes_of_eight_update_spans_both_hosts():
    pools = [CPU, gpus(8, 80, "gpu-a", "node-a", "wp-a"), gpus(8, 80, "gpu-b", "node-b", "wp-b")]
    p = plan(stage_needs(B, gpu=True), pools)
    update = p.for_stage("update")
    assert (update.processes, update.hosts, update.pools) == (16, ("node-a", "node-b"), ("gpu-a", "gpu-b"))
    assert [pl.devices for pl in update.placements] == [tuple(range(8))] * 2
    assert (update.host, update.work_pool) == ("node-a", "wp-a")  # rank 0's machine
    assert update.reason.endswith("; one launch over 2 hosts x 8 GPUs")
    assert (p.for_stage("rollout").host, p.for_stage("rollout").devices) == ("node-a", (0,))


def test_two_nodes_split_keeps_update_equal_per_host():
    # rollout takes node-b's last GPU; update gets 7 + 7 (accelerate starts the same count per machine)
    pools = [CPU, gpus(8, 80, "gpu-a", "node-a"), gpus(8, 80, "gpu-b", "node-b")]
    p = plan(stage_needs(4 * B, gpu=True), pools)
    update, rollout = p.for_stage("update"), p.for_stage("rollout")
    assert [(pl.host, pl.devices) for pl in update.placements] == [
        ("node-a", tuple(range(7))),
        ("node-b", tuple(range(7))),
    ]
    assert (rollout.host, rollout.devices) == ("node-b", (7,))


def test_update_uses_one_pool_per_host():
    pools = [CPU, gpus(6, 80, "train"), Pool("gen", "gpu", (6, 7), host="node-a", memory_gib=80)]
    p = plan(stage_needs(4 * B, gpu=True), pools)
    assert (p.for_stage("update").pools, p.for_stage("update").processes) == (("train",), 6)
    assert (p.for_stage("rollout").pool, p.for_stage("rollout").devices) == ("gen", (7,))


def test_small_gpus_go_to_rollout_big_ones_to_update():
    pools = [CPU, gpus(4, 24, "small"), gpus(2, 80, "big", host="node-b")]
    p = plan(stage_needs(4 * B, gpu=True), pools)
    assert (p.for_stage("update").pool, p.for_stage("update").devices) == ("big", (0, 1))
    assert (p.for_stage("rollout").pool, p.for_stage("rollout").devices) == ("small", (3,))


def test_any_stage_takes_gpu_room_or_falls_back_to_cpu():
    stages = [StageNeed("update", "gpu", memory_gib=60), StageNeed("judge", "any", memory_gib=10)]
    p = plan(stages, [CPU, gpus(1, 80)])
    assert (p.for_stage("judge").kind, p.for_stage("judge").devices) == ("gpu", (0,))
    stages[1] = StageNeed("judge", "any", memory_gib=30)  # 60 + 30 > 80
    judge = plan(stages, [CPU, gpus(1, 80)]).for_stage("judge")
    assert (judge.kind, judge.pool) == ("cpu", "cpu")
    assert judge.reason == "no GPU has 30 GiB free beside the GPU stages; 1 process on 16 cores"


@pytest.mark.parametrize(
    "stages, pools, message",
    [
        (
            [StageNeed("update", "gpu", 2, 2, 40)],
            [CPU, gpus(1, 24)],
            "update needs 2 GPUs with 40 GiB each; pools have 0 such (gpu: 1 x 24 GiB)",
        ),
        (
            stage_needs(4 * B, gpu=True),
            [CPU, gpus(1, 24)],
            "update needs 1 GPU with 75.5 GiB; pools have 0 such (gpu: 1 x 24 GiB)",
        ),
        (
            stage_needs(4 * B, update_processes=2, gpu=True),
            [CPU, gpus(2, 80)],
            "update + rollout need 2 + 1 GPUs apart, or 2 GPUs with 91.4 GiB each to share them; "
            "pools have 2 (gpu: 2 x 80 GiB)",
        ),
        (
            [StageNeed("update", "gpu", 10, 10, 40)],  # 8 + 4 GPUs: equal per host gives 8x1 or 4x2 = 8
            [gpus(8, 80, "a", "n1"), gpus(4, 80, "b", "n2")],
            "update needs 10 GPUs with 40 GiB each and the same number on each host; "
            "at most 8 fit that way (a: 8 x 80 GiB, b: 4 x 80 GiB)",
        ),
        (
            stage_needs(B, gpu=True),
            [CPU],
            "rollout needs a GPU but no gpu pool is declared; add one (kind: gpu) or plan for CPU",
        ),
        (
            stage_needs(B, gpu=True),
            [gpus(8, 80)],
            "prep needs a cpu pool; declare one (kind: cpu) beside the gpu pools",
        ),
        ([StageNeed("a", "cpu"), StageNeed("a", "cpu")], [CPU], "stage 'a' is listed twice"),
        ([StageNeed("a", "cpu", 2, 1)], [CPU], "stage 'a': need 1 <= min_devices <= max_devices"),
        ([StageNeed("a", "any", runs_in="b")], [CPU], "stage 'a': runs_in='b' must name another planned stage"),
        ([StageNeed("a", "cpu")], [], "no pools: declare some"),
        ([], [CPU], "no stages to plan"),
    ],
)
def test_impossible_plans_fail_with_one_line_saying_what_is_missing(stages, pools, message):
    with pytest.raises(PlanError) as e:
        plan(stages, pools)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_same_inputs_same_plan_and_dict_round_trip():
    pools = [CPU, gpus(8, 80, "gpu-a", "node-a", "wp-a"), gpus(8, 80, "gpu-b", "node-b", "wp-b")]
    for model in (B, 4 * B):
        first = plan(stage_needs(model, gpu=True), pools)
        again = plan(stage_needs(model, gpu=True), list(pools))
        assert first == again and first.table() == again.table()
        assert first.to_dict() == again.to_dict()
        assert Plan.from_dict(json.loads(json.dumps(first.to_dict()))) == first
    with pytest.raises(PlanError, match="^runs/x/plan.json: not a weaver plan"):
        Plan.from_dict({"assignments": [{"stage": "update"}]}, source="runs/x/plan.json")
    with pytest.raises(PlanError, match="plan has no stage 'train'; it has prep, rollout"):
        first.for_stage("train")


def test_table_has_a_row_per_placement():
    pools = [CPU, gpus(8, 80, "gpu-a", "node-a", "wp-a"), gpus(8, 80, "gpu-b", "node-b", "wp-b")]
    lines = plan(stage_needs(B, gpu=True), pools).table().splitlines()
    assert lines[0].split() == ["stage", "pool", "host", "procs", "devices", "shares", "with", "work", "pool", "reason"]
    assert lines[4].split()[:5] == ["update", "gpu-a", "node-a", "8", "0-7"]
    assert lines[5].split() == ["gpu-b", "node-b", "8", "0-7", "wp-b"]
    assert lines[1].split()[:6] == ["prep", "cpu", "node-a", "1", "-", "reward"]
    assert len(lines) == 7


def test_weaver_exports_the_plan_function():
    assert weaver.plan is plan


def test_plan_pools_balance_use_the_standard_library_only():
    allowed = {"__future__", "collections", "dataclasses", "typing", "math", "weaver"}
    root = Path(weaver.__file__).parent
    for name in ("plan.py", "pools.py", "balance.py", "errors.py", "apply.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            assert {m.split(".")[0] for m in mods} <= allowed, f"{name} imports {mods}"


def test_cpu_pools_reserved_by_stage_split_rollout_and_update():
    pools = pools_from_dicts(
        [
            {"name": "gen", "kind": "cpu", "cpu_cores": 1, "work_pool": "wp-gen", "stages": ["rollout", "reward"]},
            {"name": "train", "kind": "cpu", "cpu_cores": 1, "work_pool": "wp-train", "stages": ["update", "prep"]},
        ]
    )
    p = plan(stage_needs(1_000_000, gpu=False), pools)
    where = {a.stage: (a.pool, a.work_pool) for a in p.assignments}
    assert where == {
        "prep": ("train", "wp-train"),
        "rollout": ("gen", "wp-gen"),
        "reward": ("gen", "wp-gen"),
        "update": ("train", "wp-train"),
        "evaluate": ("gen", "wp-gen"),  # runs in rollout's processes
    }


def test_a_stage_no_pool_will_take_is_a_one_line_error():
    pools = pools_from_dicts([{"name": "gen", "kind": "cpu", "stages": ["rollout"]}])
    with pytest.raises(PlanError, match="prep: every cpu pool is reserved for other stages"):
        plan(stage_needs(1_000_000, gpu=False), pools)
