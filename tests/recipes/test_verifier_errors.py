"""Issue 13, acceptance 2: a verifier's errors are shown (stderr once per error text, metrics, samples.jsonl), and
one that fails on every item for reward.max_failing_steps steps stops the run with its error (exit 2)."""

from __future__ import annotations

import json

from flows.cli import main
from forge.tracking import read_metrics

TINY = ["threads=1", "checkpoint.every=0", "eval.every=0", "eval.k=0", "eval.max_problems=8", "tracking.mlflow=false",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "model.tiny.hidden=32", "model.tiny.layers=1"]  # fmt: skip
PICKY = "tests.recipes.failing_verifiers:picky"
BROKEN = "tests.recipes.failing_verifiers:broken"


def run(runs_dir, name: str, *sets: str) -> int:
    argv = ["run", "--preset", "tiny", "--name", name, "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    return main(argv + [a for s in [*TINY, *sets] for a in ("--set", s)])


def test_a_raising_verifier_is_shown_on_stderr_in_metrics_and_samples(runs_dir, capsys):
    sets = ("steps=3", f"reward.verifiers=[math_answer,{PICKY}]", "reward.max_failing_steps=0")  # a random model
    assert run(runs_dir, "picky", *sets) == 0  # rarely starts a reply with a digit: picky may fail on all 8
    err = capsys.readouterr().err
    shown = [line for line in err.splitlines() if "verifier 'picky'" in line]
    assert len(shown) == 1, err  # the same error text is printed once, not every step
    assert shown[0].startswith("forgeweave: step 1: verifier 'picky' erred on ")
    assert "ValueError('picky cannot score a reply that does not start with a digit')" in shown[0]
    rows = [r for r in read_metrics(runs_dir / "picky" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(
        0 < r["reward/picky/errors"] <= 8 and r["reward/picky/failures"] >= r["reward/picky/errors"] for r in rows
    )
    assert all(r["reward/math_answer/errors"] == 0 for r in rows)
    sample = json.loads((runs_dir / "picky" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["verifier_errors"]["picky"]["first"].startswith("ValueError('picky cannot score")
    assert sample["verifier_errors"]["picky"]["items"] == rows[0]["reward/picky/errors"]


def test_a_verifier_failing_on_every_item_stops_the_run_with_its_error(runs_dir, capsys):
    assert run(runs_dir, "broken", "steps=10", f"reward.verifiers=[math_answer,{BROKEN}]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("forgeweave: error: ")]
    assert len(errors) == 1 and errors[0] == err[-1], err
    assert "step 3: verifier 'broken' failed on every item for 3 steps in a row (reward.max_failing_steps=3)" in err[-1]
    assert "TypeError(" in err[-1] and "then --resume" in err[-1]
    status = json.loads((runs_dir / "broken" / "status.json").read_text())
    assert status["state"] == "failed" and "verifier 'broken'" in status["error"]
    assert [r["step"] for r in read_metrics(runs_dir / "broken" / "metrics.jsonl")] == [0, 1, 2]  # step 3 not trained
    # 0 = never stop: the same run goes to the end (training on what math_answer says)
    assert run(runs_dir, "tolerated", "steps=4", f"reward.verifiers=[math_answer,{BROKEN}]",
               "reward.max_failing_steps=0") == 0  # fmt: skip
    rows = read_metrics(runs_dir / "tolerated" / "metrics.jsonl")
    assert [r["reward/broken/errors"] for r in rows if r["step"] > 0] == [8.0] * 4
