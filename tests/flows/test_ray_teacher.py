"""On-policy distillation in Ray mode: the teacher is an actor of its own, on the node Weaver planned for it.

The simulated two-node cluster of tests/flows/test_ray_exec.py (pool `gen`: prep, rollout, reward, evaluate; pool
`train`: update), one update rank. The plan puts the `teacher` stage beside update (rule 8 of weaver/plan.py), so
its actor runs on the `train` node; the reward actor loads no teacher and reads the teacher actor's [N, T]
log-probs and [N, T, k] top k by reference, and the driver hands the top k to the update actor. The teacher is the
tiny student edited to prefer one token (tests/rewards/test_teacher.py's `prefers`); pure distillation (no verifier,
the top-k divergence: distill.topk = 8, the path with the most to carry between actors; the sampled-token
reward alone is the same path without the top k) must raise the student's probability of that token and lower the
reverse KL, and the first steps must equal the same run in this process (teacher inside the reward worker), though
the Ray run's teacher actor is killed at step 3 (the loop rebuilds every actor and resumes from the checkpoint at
step 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
import torch

from flows.planning import plan_run
from flows.ray_exec import RayStages
from forge.models import load_policy
from forge.presets import tiny
from forge.recipes.grpo import run as grpo_run
from tests.flows.test_ray_exec import POOLS, cluster, metrics, run  # noqa: F401  (cluster: the module's fixture)
from tests.rewards.test_teacher import X, prefers, reverse_kls, save

pytestmark = pytest.mark.slow
STEPS, SAME = 20, 4  # Ray run's steps; the first SAME of them are compared with the in-process run


def distill_cfg(tmp_path, steps: int, execution: str):
    """tiny, made small (B = 4 prompts, G = 4, 3 tokens; a 1-layer, 32-wide model) and distilling only."""
    cfg = tiny()
    cfg.steps, cfg.orchestration.execution, cfg.tracking.mlflow = steps, execution, False
    cfg.pools = [dict(p) for p in POOLS]
    cfg.model.tiny.hidden, cfg.model.tiny.layers = 32, 1
    cfg.data.train_size, cfg.data.eval_size = 40, 4
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
    cfg.update.lr, cfg.update.max_grad_norm, cfg.update.adaptive.enabled = 0.1, 1.0, False  # 1e-2: flat for 20 steps
    cfg.update.num_processes = 1
    cfg.eval.every, cfg.eval.k, cfg.eval.max_problems, cfg.eval.verifiers = 0, 0, 4, ["format_integer"]
    cfg.checkpoint.every = 2  # the killed teacher's run resumes from step 2
    cfg.reward.verifiers = []
    cfg.distill.teacher, cfg.distill.topk = str(tmp_path / "teacher"), 8
    return cfg


class KillsTheTeacher(RayStages):
    """RayStages that SIGKILLs the teacher actor's process as step AT's teacher stage starts (the checkpoint at step
    AT - 1 written), so the teacher call finds its actor dead."""

    AT = 3
    before: list[dict] = []  # where the workers were when the teacher was killed
    calls = 0  # teacher stages run by the first instance: one per step

    def teacher(self, rollouts):
        KillsTheTeacher.calls += 1
        if KillsTheTeacher.calls == self.AT and not self.before:
            self.wait_saved()
            self.before.append(self.where())
            os.kill(self.before[0]["teacher"][0]["pid"], signal.SIGKILL)
        return super().teacher(rollouts)


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):  # noqa: F811
    """(the Ray run's config, its directory, the in-process run of its first SAME steps, (untrained student, tokenizer))."""
    tmp = tmp_path_factory.mktemp("distill")
    cfg = distill_cfg(tmp, STEPS, "ray")
    start, tok = load_policy(cfg.model, seed=cfg.seed)
    save(prefers(start, tok, X, gap=2.0), tok, tmp / "teacher")
    KillsTheTeacher.before, KillsTheTeacher.calls = [], 0
    summary = grpo_run(cfg, tmp / "ray", progress=False, plan=plan_run(cfg)[1], stages=KillsTheTeacher,
                       execution="ray")  # fmt: skip
    assert summary["steps"] == STEPS and summary["restarts"] == 1
    local = distill_cfg(tmp, SAME, "embedded")
    assert run(local, tmp / "local")["execution"] == "embedded"
    return cfg, tmp / "ray", tmp / "local", (start, tok)


def test_the_plan_places_the_teacher_beside_update(tmp_path):
    cfg = distill_cfg(tmp_path, STEPS, "ray")
    with pytest.raises(Exception, match=r"distill.teacher '.*teacher' does not exist"):
        plan_run(cfg)  # no directory yet: one line naming it, at planning
    start, tok = load_policy(cfg.model, seed=cfg.seed)
    save(start, tok, tmp_path / "teacher")
    plan, _ = plan_run(cfg)
    teacher, update = plan.for_stage("teacher"), plan.for_stage("update")
    assert teacher.pools == update.pools == ("train",) and teacher.processes == 1
    assert teacher.colocated_with == ("update",) and "teacher" in update.colocated_with


def test_the_teacher_is_an_actor_of_its_own_on_the_planned_node_rebuilt_when_lost(cluster, runs):  # noqa: F811
    """Before and after the teacher was killed (the run rebuilt every actor, `restarts` == 1): a process of its own
    on the `train` node, where the plan put it."""
    _, d, _, _ = runs
    (before,), after = KillsTheTeacher.before, json.loads((d / "workers.json").read_text())
    for where in (before, after):
        (teacher,) = where["teacher"]
        assert teacher["stage"] == "teacher" and teacher["pool"] == "train" and teacher["node_id"] in cluster["train"]
        pids = [w["pid"] for ws in where.values() for w in ws]
        assert len(set(pids)) == len(pids) == 4 and os.getpid() not in pids  # update, rollout, reward, teacher
        assert {r["node_id"] for r in where["reward"]} <= set(cluster["gen"])
    assert after["teacher"][0]["pid"] != before["teacher"][0]["pid"]


def test_ray_distillation_learns_the_teachers_token(runs):
    """Measured: reverse KL 6.7 (rising to 8.1 at step 3) -> 0.35 at step 9 -> 0.0 from step 10 on, and P(X) after the
    prompts 0.010 -> 1.000 (at update.lr = 1e-2 the KL stays at ~6.7 for 20 steps: too slow for this test).

    Over seeds (2026-12-05; the seed draws the student and so the teacher edited from it), this test with the seed
    changed (~57 s a run), P(X) before -> after and reverse KL first -> last: seed 0 0.010 -> 1.000, 6.72 -> 0.001;
    1 0.008 -> 1.000, 6.70 -> 0.001; 2 0.011 -> 1.000, 6.25 -> 0.001; 3 0.011 -> 1.000, 6.69 -> 0.001. The same
    config in this process (`python bench/seed_spread.py --scenarios rayteacher`, no kill) gives the same at seeds
    0-7. Chance: P(X) = 1/99 = 0.010, the KL unchanged. The test runs seed 0 and asks P(X) > 0.9 and the KL below
    half its first value."""
    cfg, d, _, (start, tok) = runs
    kl = reverse_kls(d)
    assert len(kl) == STEPS and kl[-1] < kl[0] / 2, kl
    ckpt = str(d / "checkpoints" / f"step-{STEPS:06d}")
    end, _ = load_policy(dataclasses.replace(cfg.model, path=ckpt))
    prompts = tok(["1+2=", "4+4=", "3+5=", "0+6="], return_tensors="pt")
    x = tok.convert_tokens_to_ids(X)
    with torch.no_grad():
        before, after = (float(m.eval()(**prompts).logits[:, -1].softmax(-1)[:, x].mean()) for m in (start, end))
    assert before < 0.05 and after > 0.9, (before, after)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/teacher_s"] > 0 for r in rows if "distill/reverse_kl" in r)  # timed by the driver


def test_the_first_steps_equal_the_in_process_run(runs):
    """The teacher actor's log-probs are the reward worker's own, to float rounding, and the run killed at step 3
    resumed as if uninterrupted: the same metrics step by step (the same sampled tokens, so equal counts) over the
    first SAME steps."""
    _, d, local, _ = runs
    assert_same_steps(d, local)


def assert_same_steps(ray_dir, local_dir) -> None:
    """Steps 0..SAME of the Ray run have the in-process run's metrics (eval reports left out: the local run's last
    step has one)."""
    ray_rows, local_rows = ([{k: v for k, v in m.items() if not k.startswith("eval/")} for m in rows]
                            for rows in (metrics(ray_dir)[: SAME + 1], metrics(local_dir)))  # fmt: skip
    assert [m["step"] for m in ray_rows] == [m["step"] for m in local_rows] == list(range(SAME + 1))
    assert {"distill/reverse_kl", "distill/topk_kl", "train/loss"} <= ray_rows[SAME].keys()
    for x, y in zip(ray_rows, local_rows, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
