"""Issue 13, acceptance 1: the TRL-style example (examples/trl_style: a chat-message `prompt` column and an integer
`target` column saved with `datasets.save_to_disk`, two reward functions written for TRL) runs unchanged with
`forgeweave run` and with `forge.train`, and learns on the tiny model.

Learning, as measured on this machine (seed 0): through `forge.train`, 40 steps, the mean reward (reward_format +
reward_correct) goes from 0.04 over steps 1-5 to 0.9 over steps 36-40 (asked: a rise of 0.5); through `forgeweave
run`, 150 steps with the correctness reward weighted up and groups of 32, greedy pass@1 rises (numbers and the
seed spread in each test's docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

import forge
from flows.cli import main
from forge.tracking import read_metrics

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_style"
SETS = ["steps=40", "threads=1", "eval.every=0", "checkpoint.every=0", "tracking.mlflow=false", "eval.k=0",
        "model.chat_template=true", "data.eval_split=test", "data.answer_column=target"]  # fmt: skip
VERIFIERS = "reward.verifiers=[trl_rewards:reward_format,trl_rewards:reward_correct]"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example's dataset and tiny chat model, built by its own script; its reward module importable."""
    sys.path.insert(0, str(EXAMPLE))
    import build_dataset

    root = tmp_path_factory.mktemp("trl")
    build_dataset.build(root / "arith-chat")
    build_dataset.tiny_chat_model(root / "tiny-chat")
    yield root
    sys.path.remove(str(EXAMPLE))


def overrides(example: Path) -> list[str]:
    return [f"model.path={example / 'tiny-chat'}", f"data.source={example / 'arith-chat'}", *SETS]


def rise(run_dir: Path) -> float:
    """Mean reward over the last 5 steps minus over the first 5."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert all(r["reward/reward_format/errors"] == r["reward/reward_correct/errors"] == 0 for r in rows)
    first, last = rows[:5], rows[-5:]
    return sum(r["reward/mean"] for r in last) / 5 - sum(r["reward/mean"] for r in first) / 5


@pytest.mark.slow
def test_trl_example_learns_with_forgeweave_run(example, runs_dir):
    """Correctness, not only the format: reward.weights=[0.1,1.0] (the example README's advice), groups of 32,
    150 steps. Asked: reward_correct rises >= 0.05 (steps 1-10 -> 141-150) and greedy pass@1 on the test split
    (decided by reward_correct: eval.verifiers' default) gains >= 0.05 (3 of 55 sums); without learning both stay
    at 0 (chance: a random reply is rarely a bare integer, and the seeds that never find the sums keep 0.000).

    Measured 2026-12-05 (`python bench/seed_spread.py --scenarios trl --seeds 0,1,2,3`, ~65-75 s a run here),
    reward_correct rise / pass@1 after 150 steps, from 0.00: seed 0 0.086 / 0.07, 1 0.145 / 0.18, 2 0.140 / 0.18,
    3 0.391 / 0.58. The test runs seed 2 (typical). Groups of 32 are what make every seed learn: correct sums are
    rare at the start, and once the format is learned the samples narrow onto wrong integers (e.g. "099"). With the
    default 16 x 16 and 300 steps (the same time) seeds 1 and 3 learned (rise 0.17 and 0.18, pass@1 0.18) while 0
    and 2 kept reward_correct at ~0 and pass@1 at 0 (2026-12-03), as did seeds 0 and 2 with update.lr=2e-3, seed 0
    with the adaptive LR off, and seed 1 with 8 x 32. With 16 x 32 and 300 steps (twice the time) the four seeds
    reach pass@1 0.76, 0.89, 0.84, 0.80."""
    argv = ["run", "--preset", "tiny", "--name", "trl", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    sets = [*overrides(example), VERIFIERS, "reward.weights=[0.1,1.0]", "rollout.group_size=32", "steps=150",
            "eval.every=150", "seed=2"]  # fmt: skip
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    rows = [r for r in read_metrics(runs_dir / "trl" / "metrics.jsonl") if r["step"] > 0]
    correct = [r["reward/reward_correct/mean"] for r in rows]
    assert sum(correct[-10:]) / 10 - sum(correct[:10]) / 10 >= 0.05
    evals = [r for r in read_metrics(runs_dir / "trl" / "metrics.jsonl") if "eval/pass@1" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 150
    assert evals[-1]["eval/pass@1"] - evals[0]["eval/pass@1"] >= 0.05
    cfg = yaml.safe_load((runs_dir / "trl" / "config.yaml").read_text())
    assert cfg["data"]["source"] == str(example / "arith-chat") and cfg["data"]["eval_split"] == "test"


@pytest.mark.slow
def test_trl_example_learns_with_forge_train(example, tmp_path):
    """Measured 2026-12-05 (`python bench/seed_spread.py --scenarios trlapi --seeds 0,1,2,3,4,5,6,7`, ~12 s a run), mean
    reward (reward_format + reward_correct) over steps 1-5 -> 36-40: seed 0 0.013 -> 0.982, 1 0.002 -> 0.970, 2 0.015
    -> 0.988, 3 0.016 -> 0.977, 4 0.018 -> 0.986, 5 0.012 -> 0.973, 6 0.002 -> 0.974, 7 0.006 -> 0.982 (rises
    0.961-0.976): the format is learnt, rarely the right sum. The test runs seed 0 and asks a rise of 0.5 (the worst
    seed's: 0.961); chance (no learning) is a rise of 0."""
    from datasets import load_from_disk
    from trl_rewards import reward_correct, reward_format

    data = load_from_disk(str(example / "arith-chat"))
    sets = [s for s in overrides(example) if not s.startswith(("data.source", "data.eval_split"))]
    summary = forge.train(preset="tiny", dataset=data["train"], eval_dataset=data["test"], progress=False,
                          reward_funcs=[reward_format, reward_correct], run_dir=tmp_path / "api", overrides=sets)  # fmt: skip
    assert summary["steps"] == 40
    assert rise(tmp_path / "api") >= 0.5
