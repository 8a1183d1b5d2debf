"""Issue 6, acceptance 4: the tiny task learns with NO access to the reference answers.

`--preset tiny-unlabeled` (forge/presets.py): the verifiers are four label-free rule checks (parity, residue mod 3,
residue mod 5, digit count of the true result computed from the prompt; forge/tasks/arith.py), `reward.label_free`
hides the answer column from them, and the reward is P(correct) from the latent class ensemble
(forge/rewards/latent_class.py) refit every step on the last 8 steps' rollouts. Evaluation -- greedy pass@1 on all 55
single-digit sums -- is the only place the true answers are read. The test also reads them, from samples.jsonl, to
check that the label-free reward agreed with the truth.
"""

import json

import pytest

from flows.cli import main
from forge.rewards.math import answers_match, extract_answer


@pytest.mark.parametrize("seed", [2])
def test_tiny_unlabeled_preset_learns_without_answers(runs_dir, seed):
    args = ["run", "--preset", "tiny-unlabeled", "--name", "u", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    assert main([*args, "--set", f"seed={seed}"]) == 0
    run = runs_dir / "u"
    assert "label_free: true" in (run / "config.yaml").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["initial"]["pass@1"] <= 0.05
    # measured 2026-12-04 with rollout seeds derived from (seed, step), seeds 0-15: 0.24 0.18 0.31 0.18 0.18 0.31 0.29
    # 0.18 0.42 0.44 0.29 0.16 0.18 0.40 0.71 0.40 (mean 0.30; the RNG streams they replaced: mean 0.37, not a
    # significant difference, Mann-Whitney z = 1.28); asked: at least the lowest of them, from <= 0.05. Again
    # 2026-12-06 with the adaptive LR cutting only for a spike that holds (`python bench/seed_spread.py --scenarios
    # lf --seeds 0,1,2,3`): 0.16 0.18 0.36 0.18
    assert summary["eval"]["final"]["pass@1"] >= 0.15
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    refits = [m for m in metrics if "ensemble/accepted" in m]
    assert len(refits) == summary["steps"] and all(m["ensemble/parity_check/weight"] > 0 for m in refits)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    right = [s["reward"] for s in samples if answers_match(extract_answer(s["completion"]), s["answer"])]
    wrong = [s["reward"] for s in samples if not answers_match(extract_answer(s["completion"]), s["answer"])]
    assert sum(right) / len(right) > 0.8 and sum(wrong) / len(wrong) < 0.05  # the reward knew, without answers


def test_tiny_unlabeled_trains_on_a_file_without_answers(runs_dir, tmp_path):
    """Issue 17: a training file with no answer column (reward.label_free, so the preset's reward never needed
    one) and a labelled eval file; the run trains a few steps and evaluates against the eval file's answers."""
    sums = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a, b in sums))
    labelled = "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n" for a, b in sums[::6])
    (tmp_path / "eval.jsonl").write_text(labelled)
    args = ["run", "--preset", "tiny-unlabeled", "--name", "f", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    short = ["steps=3", "eval.every=0", "eval.k=0", "checkpoint.every=0", "tracking.mlflow=false",
             "rollout.prompts_per_step=4", f"data.source={tmp_path / 'train.jsonl'}",
             f"data.eval_source={tmp_path / 'eval.jsonl'}"]  # fmt: skip
    assert main([*args, *(x for s in short for x in ("--set", s))]) == 0
    run = runs_dir / "f"
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    assert (manifest["train_rows"], manifest["eval_rows"], manifest["train_labelled"]) == (55, 10, False)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and "pass@1" in summary["eval"]["final"]
    final = json.loads((run / "eval" / "step-000003.json").read_text())
    assert final["problems"] == 10 and final["verifiers"] == ["math_answer"]  # scored against eval.jsonl's answers
    assert {s["answer"] for s in final["samples"]} <= {str(a + b) for a, b in sums[::6]}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m and "ensemble/accepted" in m] == [1, 2, 3]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["answer"] is None for s in samples)  # training rows have no answer to show
