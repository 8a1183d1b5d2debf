"""Acceptance (issue 17): with reward.label_free the reward path never sees an answer column, also through the
Prefect flow (embedded mode) and in Ray mode, where the reward stage runs in an actor (another process).

The in-process reward stage is covered in test_trl_calls.py; here a real run trains with an import-path verifier
(`tests/rewards/recording.py`) that writes down, call by call, the keyword names it got and every column's values:
the reward stage's calls and evaluation's (its `mean_reward` runs the reward verifiers on the eval rows, and is
given the same columns as the reward stage).
The data hold the answers under data.answer_column = `solution` (so the stored `answer` copy exists too); the
other columns are chosen so that none of their values can equal a reference answer, which makes "no answer value
reached the verifier through any column" a plain set check. Evaluation reads the answers (eval.verifiers =
math_answer, so the recorder is never an eval verifier).
"""

from __future__ import annotations

import json
import os

import pytest

from flows.cli import main
from tests.rewards.recording import ENV, SPEC, as_text, read_records

pytestmark = pytest.mark.slow  # ~45 s each on 2 busy cores: Prefect's embedded server / a private Ray start up
SUMS = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]


def write_data(tmp_path) -> tuple[str, set[str]]:
    """A labelled training file (answers under `solution`, ints) with extra columns; returns it and its answers."""
    rows = [{"prompt": f"{a}+{b}=", "solution": a + b, "topic": "sum", "level": 100 + i} for i, (a, b) in
            enumerate(SUMS)]  # fmt: skip
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = {as_text(r["solution"]) for r in rows} | {str(r["solution"]) for r in rows}
    return str(path), answers


def run_args(runs_dir, name: str, source: str) -> list[str]:
    keys = ["steps=2", "eval.every=0", "eval.k=0", "eval.max_problems=8", "checkpoint.every=0",
            "tracking.mlflow=false", "rollout.prompts_per_step=4", "rollout.group_size=4", f"data.source={source}",
            "data.answer_column=solution", "data.eval_size=8", "reward.label_free=true",
            f"reward.verifiers=[{SPEC},parity_check]", "eval.verifiers=[math_answer]"]  # fmt: skip
    return ["run", "--preset", "tiny", "--name", name, "--runs-dir", str(runs_dir), "--quiet",
            *(x for k in keys for x in ("--set", k))]  # fmt: skip


def split_records(records: list[dict], answers: set[str]) -> tuple[list[dict], list[dict]]:
    """Check every call, then split them into (reward stage calls, eval's `mean_reward` calls)."""
    for r in records:
        assert "answer" not in r["keys"] and "solution" not in r["keys"], r["keys"]
        assert {"id", "topic", "level"} <= set(r["keys"])  # the other columns still came
        for column, values in r["columns"].items():
            assert not answers & set(values), f"column {column!r} carried reference answers"
    stage = [r for r in records if "trainer_state" in r["keys"]]  # TRL's extras come with the reward stage only
    evals = [r for r in records if "trainer_state" not in r["keys"]]
    # one batch call per step (the recorder never fails: no item-by-item retry); eval at step 0 and at the end
    assert (len(stage), len(evals)) == (2, 2) and all("completion_ids" in r["keys"] for r in stage)
    return stage, evals


def test_prefect_flow_reward_never_sees_answers(runs_dir, tmp_path, monkeypatch):
    source, answers = write_data(tmp_path)
    monkeypatch.setenv(ENV, str(tmp_path / "calls.jsonl"))
    assert main(run_args(runs_dir, "pf", source)) == 0  # no --no-prefect: the embedded Prefect flow
    assert "prefect_flow_run_id" in json.loads((runs_dir / "pf" / "summary.json").read_text())
    split_records(read_records(tmp_path / "calls.jsonl"), answers)


def test_ray_mode_reward_never_sees_answers(runs_dir, tmp_path, monkeypatch):
    source, answers = write_data(tmp_path)
    monkeypatch.setenv(ENV, str(tmp_path / "calls.jsonl"))
    args = [*run_args(runs_dir, "ray", source), "--no-prefect", "--set", "orchestration.execution=ray"]
    assert main(args) == 0  # a private Ray instance; the reward stage runs in an actor
    assert json.loads((runs_dir / "ray" / "summary.json").read_text())["execution"] == "ray"
    stage, evals = split_records(read_records(tmp_path / "calls.jsonl"), answers)
    workers = json.loads((runs_dir / "ray" / "workers.json").read_text())
    reward_pids, rollout_pids = ({w["pid"] for w in workers[s]} for s in ("reward", "rollout"))
    assert os.getpid() not in reward_pids | rollout_pids  # the actors are other processes
    assert {r["pid"] for r in stage} == reward_pids and {r["pid"] for r in evals} <= rollout_pids  # eval: rollout
