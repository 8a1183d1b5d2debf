"""The `majority` (TTRL's majority vote) and `mean` reward baselines (issue 17, part 2): the pure functions, the
reward stage's use of them, and one tiny run each."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flows.cli import main
from forge.compose import reward_worker
from forge.config import ConfigError, RunConfig, overlay
from forge.rewards.aggregate import majority_rewards, majority_vote, mean_scores
from tests.rewards.test_trl_calls import fake_rollouts

NAN = math.nan
SHORT = ["--quiet", "--no-prefect", "--set", "steps=3", "--set", "eval.every=0", "--set", "eval.k=0",
         "--set", "eval.max_problems=8", "--set", "checkpoint.every=0", "--set", "tracking.mlflow=false",
         "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=8"]  # fmt: skip


def test_mean_ignores_missing_scores_and_all_missing_is_zero():
    scores = torch.tensor([[1.0, 0.0, 0.5, 0.5], [NAN, 1.0, NAN, 0.0], [NAN, NAN, NAN, NAN], [2.0, NAN, 1.0, NAN]])
    # (1 + 0 + .5 + .5) / 4 = .5; (1 + 0) / 2 = .5; none scored: 0; (2 + 1) / 2 = 1.5
    assert mean_scores(scores).tolist() == [0.5, 0.5, 0.0, 1.5]
    assert mean_scores(scores).dtype == torch.float32


def test_majority_vote_skips_no_answer_and_breaks_ties_by_first_seen():
    assert majority_vote([None, None, "3", None]) == "3"  # None (no answer) never wins, however common
    assert majority_vote(["5", "4", "4", "5"]) == "5"  # 2 against 2: the first seen
    assert majority_vote(["4", "5", "5"]) == "5"
    assert majority_vote([]) is None and majority_vote([None]) is None


def test_majority_compares_normalised_final_answers_per_group():
    texts = [
        "1,234", "The answer is 1234.", r"\boxed{1234.0}", "1233",  # group 1: three spellings of 1234
        "7", "8", "7 apples? no: 8", "no idea",  # group 2: 7, 8, 8 (its last number), none -> 8
        "hmm", "not sure", "?", "...",  # group 3: no answer at all -> all 0
    ]  # fmt: skip
    assert majority_rewards(texts, 4).tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]


def reward_cfg(aggregate: str, verifiers: list[str]) -> RunConfig:
    cfg = RunConfig(steps=5)
    cfg.reward.aggregate, cfg.reward.verifiers = aggregate, verifiers
    return cfg


ROWS = [{"id": f"r{i}", "prompt": f"{i}+2=", "model_input": f"{i}+2=", "answer": str(i + 2)} for i in (1, 2)]


def test_reward_stage_majority_votes_and_still_runs_the_verifiers():
    worker = reward_worker(reward_cfg("majority", ["math_answer", "format_integer"]))
    texts = ["3", "3", "4", "no", "5", "4", "4 x", "4"]  # group 1: majority 3 (right); group 2: majority 4 (wrong)
    scored = worker.score(ROWS, fake_rollouts(2, 4, texts), step=1)
    b = scored
    assert b.rewards.tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
    assert b.scores[:, 0].tolist() == [1, 1, 0, 0, 0, 1, 1, 1]  # math_answer ran (here it agrees with the vote)
    assert b.scores[:, 1].tolist() == [1, 1, 1, 0, 1, 1, 0.5, 1]  # format_integer ran too
    assert b.reward_metrics == {"reward/majority_share": 0.625} and scored.ensemble_report is None  # 5 of 8
    adv = b.advantages.view(2, 4)
    assert torch.allclose(adv.sum(1), torch.zeros(2), atol=1e-6) and adv[0, 0] > 0 > adv[0, 2]


def test_reward_stage_mean_averages_the_scores():
    worker = reward_worker(reward_cfg("mean", ["math_answer", "format_integer"]))
    scored = worker.score(ROWS, fake_rollouts(2, 2, ["3", "3 ok", "4", "x"]), step=1)
    # math_answer [1, 1, 1, 0], format_integer [1, .5, 1, 0]: means 1, .75, 1, 0 (weights play no part)
    assert scored.rewards.tolist() == [1.0, 0.75, 1.0, 0.0] and scored.reward_metrics == {}


def test_aggregate_names_are_checked():
    assert overlay(RunConfig(), {"reward": {"aggregate": "majority"}}).reward.aggregate == "majority"
    with pytest.raises(ConfigError, match="reward.aggregate.*mean"):
        overlay(RunConfig(), {"reward": {"aggregate": "vote"}})


def run_tiny(runs_dir, name: str, *overrides: str) -> tuple[list[dict], list[dict]]:
    args = ["run", "--preset", "tiny", "--name", name, "--runs-dir", str(runs_dir), *SHORT]
    assert main([*args, *(x for o in overrides for x in ("--set", o))]) == 0
    run = runs_dir / name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return [m for m in metrics if "reward/mean" in m], samples


def test_tiny_run_with_majority_rewards(runs_dir):
    metrics, samples = run_tiny(runs_dir, "maj", "reward.aggregate=majority", "reward.verifiers=[math_answer]")
    assert len(metrics) == 3
    for m in metrics:
        assert m["reward/majority_share"] == pytest.approx(m["reward/mean"])  # 1 for each majority completion
        assert "reward/math_answer/mean" in m  # the verifier still ran and is logged
    for step in (1, 2, 3):  # samples.jsonl holds each step's first group (8 completions = G)
        group = [s for s in samples if s["step"] == step]
        assert [s["reward"] for s in group] == majority_rewards([s["completion"] for s in group], 8).tolist()


def test_tiny_run_with_mean_rewards(runs_dir):
    metrics, samples = run_tiny(runs_dir, "mean", "reward.aggregate=mean",
                                "reward.verifiers=[math_answer,format_integer]")  # fmt: skip
    assert len(metrics) == 3 and "reward/majority_share" not in metrics[0]
    for s in samples:
        scores = [v for v in s["scores"].values() if v is not None]
        assert s["reward"] == pytest.approx(sum(scores) / len(scores) if scores else 0.0)
