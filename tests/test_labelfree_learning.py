"""Issue 6, acceptance 4: the tiny task learns with NO access to the reference answers.

`--preset tiny-unlabeled` (forge/presets.py): the verifiers are four label-free rule checks (parity, residue mod 3,
residue mod 5, digit count of the true result computed from the prompt; forge/rewards/weak.py), `reward.label_free`
hides the answer column from them, and the reward is P(correct) from the latent class ensemble
(forge/rewards/latent_class.py) refit every step on the last 8 steps' rollouts. Evaluation -- greedy pass@1 on all 55
single-digit sums -- is the only place the true answers are read. The test also reads them, from samples.jsonl, to
check that the label-free reward agreed with the truth.
"""

import json

import pytest

from flows.cli import main
from forge.rewards.math import answers_match, extract_answer


@pytest.mark.parametrize("seed", [0])
def test_tiny_unlabeled_preset_learns_without_answers(runs_dir, seed):
    args = ["run", "--preset", "tiny-unlabeled", "--name", "u", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    assert main([*args, "--set", f"seed={seed}"]) == 0
    run = runs_dir / "u"
    assert "label_free: true" in (run / "config.yaml").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["initial"]["pass@1"] <= 0.05
    assert summary["eval"]["final"]["pass@1"] >= 0.3  # measured: 0.58 (seeds 1-3: 0.45, 0.42, 0.42)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    refits = [m for m in metrics if "ensemble/accepted" in m]
    assert len(refits) == summary["steps"] and all(m["ensemble/parity_check/weight"] > 0 for m in refits)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    right = [s["reward"] for s in samples if answers_match(extract_answer(s["completion"]), s["answer"])]
    wrong = [s["reward"] for s in samples if not answers_match(extract_answer(s["completion"]), s["answer"])]
    assert sum(right) / len(right) > 0.8 and sum(wrong) / len(wrong) < 0.05  # the reward knew, without answers
