"""Acceptance 3 of issue 30: a TRL-style environment class, written as TRL's documentation shows one, runs unchanged
through `forge.train(environment_factory=...)` and its reward (read by a TRL reward function from `environments=`)
rises on the tiny random model."""

from __future__ import annotations

import pytest

import forge
from forge.tracking import read_metrics
from tests.env.graded import reward_func


class GuessEnv:
    def __init__(self):
        self.answer = ""
        self.reward = 0.0

    def reset(self, **kwargs):
        self.answer = str(kwargs["answer"])
        self.reward = 0.0
        return None

    def guess(self, value: int) -> str:
        """Guess the sum.

        Args:
            value: the guessed sum
        """
        self.reward = float(str(value) == self.answer)
        return "right" if self.reward else "wrong"


@pytest.mark.slow
def test_a_trl_environment_class_learns_on_the_tiny_model(tmp_path):
    sets = ["steps=30", "threads=1", "tracking.mlflow=false", "checkpoint.every=0", "eval.every=0",
            "rollout.max_new_tokens=3", "update.lr=2e-3"]  # fmt: skip
    forge.train(preset="tiny-multiturn", environment_factory=GuessEnv, reward_funcs=[reward_func], overrides=sets,
                run_dir=tmp_path / "run", progress=False)  # fmt: skip
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0 and "reward/mean" in r]
    assert all("env/turns" in r and r["env/turns"] >= 1 and "env/tool_calls" in r for r in rows)
    first, last = rows[:5], rows[-5:]
    rise = sum(r["reward/mean"] for r in last) / 5 - sum(r["reward/mean"] for r in first) / 5
    # measured 2026-12-05 (threads=1, `python bench/seed_spread.py --scenarios mt --seeds 0,1,2,3,4,5,6,7`, ~12 s a
    # run), reward/mean over steps 1-5 -> steps 26-30: seed 0 0.123 -> 0.254 (rise 0.130), 1 0.141 -> 0.284 (0.144),
    # 2 0.141 -> 0.263 (0.121), 3 0.138 -> 0.260 (0.122), 4 0.143 -> 0.268 (0.125), 5 0.145 -> 0.270 (0.125),
    # 6 0.112 -> 0.270 (0.158), 7 0.133 -> 0.258 (0.125); on 2026-12-06, the adaptive LR cutting only for a spike
    # that holds, seeds 0-3 rose 0.134, 0.146, 0.121, 0.122. The test runs seed 0 and asks a rise above 0.08, below the
    # worst seed's 0.121; chance (no learning) is a rise of 0. What is learnt is the digit format (0.25 a reply with
    # a digit); the tiny model never calls the tool in 30 steps: the tool path is tests/env/test_episode.py's
    assert rise > 0.08, rise


def test_the_tiny_multiturn_preset_runs_from_the_cli(runs_dir):
    """Smoke: `forgeweave run --preset tiny-multiturn` (environment and reward function by import path)."""
    import json

    from flows.cli import main

    argv = ["run", "--preset", "tiny-multiturn", "--name", "mt", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    sets = ["steps=2", "threads=1", "tracking.mlflow=false", "data.train_size=100", "eval.max_problems=5"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    rows = [r for r in read_metrics(runs_dir / "mt" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["env/turns"] >= 1 and "reward/sum_reward/mean" in r for r in rows)
    sample = json.loads((runs_dir / "mt" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["transcript"][0]["role"] == "assistant" and sample["transcript"][0]["policy_version"] == 0
    final = json.loads((runs_dir / "mt" / "summary.json").read_text())["eval"]["final"]
    # SumEnv has no on_reply and the tiny model calls no tool: one turn, the first is the final one
    assert final["first_turn@1"] == final["final_turn@1"] and final["mean_turns"] == 1.0 and final["problems"] == 5


def test_the_multiturn_bench_runs_and_reuses_its_results(tmp_path):
    """Smoke: bench/multiturn.py on the tiny preset (1 step); a second call reads the recorded seed back."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "bench" / "multiturn.py"), "--preset", "tiny-multiturn", "--steps", "1",
           "--eval-rows", "4", "--out", str(tmp_path), "--quiet", "--set", "threads=1", "--set", "data.train_size=50"]  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "seed 0: 1 steps, 4 held-out rows" in first.stdout and "after: final - first = +0.000" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    assert again.returncode == 0 and len((tmp_path / "results.jsonl").read_text().splitlines()) == 1
