"""Rollout as vLLM engine replicas in the plan: replicas x tensor-parallel devices, and the config wiring."""

from flows.planning import make_plan
from forge.presets import get_preset
from weaver.plan import plan, stage_needs
from weaver.pools import Pool

CPU = Pool("cpu", "cpu", host="node-a", cpu_cores=16, memory_gib=256)
GPUS = Pool("gpu", "gpu", tuple(range(8)), host="node-a", cpu_cores=16, memory_gib=80)
B = 1_000_000_000


def test_tensor_parallel_replicas_take_their_own_gpus():
    # 4B: update 75.5 GiB does not leave room for rollout on its GPUs -> split. Rollout per device with tp=2:
    # 4e9 * 2 B * 2 / 2**30 / 2 + 1 = 8.45 GiB; 2 replicas x 2 devices = 4 devices, the last ones (rule 4)
    needs = {n.name: n for n in stage_needs(4 * B, rollout_replicas=2, rollout_tp=2, gpu=True)}
    assert (needs["rollout"].min_devices, needs["rollout"].max_devices) == (4, 4)
    assert needs["rollout"].memory_gib == 8.45
    p = plan(list(needs.values()), [CPU, GPUS])
    assert p.for_stage("rollout").devices == (4, 5, 6, 7)
    assert p.for_stage("update").devices == (0, 1, 2, 3)


def test_config_replicas_reach_the_plan_on_cpu():
    cfg = get_preset("tiny")
    cfg.rollout.backend, cfg.rollout.replicas = "vllm", 2
    assert make_plan(cfg, [CPU]).for_stage("rollout").processes == 2
    cfg.rollout.backend = "hf"  # hf copies are rollout actors too (Ray mode)
    assert make_plan(cfg, [CPU]).for_stage("rollout").processes == 2
    cfg.rollout.replicas = 1
    assert make_plan(cfg, [CPU]).for_stage("rollout").processes == 1
