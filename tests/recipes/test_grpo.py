"""The loop in forge.recipes.grpo against a hand-written synchronous GRPO over the same workers.

With algo.max_staleness = 0 the loop must be exactly the synchronous algorithm: sample from the current policy,
score, update, repeat. The reference below builds the same three workers and runs that sequence by hand; the
final weights must be bitwise equal (same seed, same single process: no float tolerance is needed).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from forge.compose import reward_worker, rollout_worker
from forge.data import prompt_batch, read_split
from forge.presets import tiny
from forge.recipes.grpo import run
from forge.rollout import SamplingParams
from tests.grpo_parts import TrainerWorker

STEPS = 3


def small_cfg():
    cfg = tiny()
    cfg.steps, cfg.tracking.mlflow = STEPS, False
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
    cfg.eval.every, cfg.eval.max_problems, cfg.eval.k = 0, 8, 0
    return cfg


def synchronous_by_hand(cfg, run_dir) -> dict[str, torch.Tensor]:
    trainer = TrainerWorker(cfg)
    rollout = rollout_worker(cfg, model=trainer.trainer.unwrapped, tokenizer=trainer.tokenizer)
    reward = reward_worker(cfg)
    train = read_split(run_dir, "train")
    r = cfg.rollout
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, n=r.group_size)
    for step in range(1, cfg.steps + 1):
        rows = prompt_batch(train, cfg.seed, (step - 1) * r.prompts_per_step, r.prompts_per_step)
        ro = rollout.generate([row["model_input"] for row in rows], params, trainer.policy_version)
        trainer.step(ro, reward.score(rows, ro, step).advantages)
        rollout.load_weights(None, trainer.policy_version)
    return {k: v.detach().clone() for k, v in trainer.trainer.unwrapped.state_dict().items()}


@pytest.mark.parametrize("correction", ["auto", "none"])
def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path, correction):
    cfg = small_cfg()
    cfg.algo.is_correction = correction  # auto resolves to none on-policy
    d = tmp_path / "run"
    summary = run(cfg, d, progress=False)
    assert summary["steps"] == STEPS
    got = load_file(d / "checkpoints" / f"step-{STEPS:06d}" / "model.safetensors")
    want = synchronous_by_hand(small_cfg(), d)  # reads the run's prepared data split
    assert got.keys() <= want.keys() and len(got) >= len(want) - 1  # a tied lm_head is saved once
    assert all(torch.equal(got[k], want[k]) for k in got)
