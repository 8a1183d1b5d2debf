"""The unlabeled arithmetic task's shipped files (forge/tasks/arith.py) and the preset that trains on them."""

import json

from forge.presets import get_preset
from forge.rewards.registry import CORRECTNESS
from forge.tasks.arith import EVAL_FILE, PROBE_FILE, TRAIN_FILE, generate, to_jsonl


def test_shipped_files_match_the_generator():
    for path, rows in zip((TRAIN_FILE, EVAL_FILE, PROBE_FILE), generate(), strict=True):
        assert path.read_bytes() == to_jsonl(rows), f"{path.name} is stale: run python -m forge.tasks.arith"


def test_train_file_has_no_answers_and_the_splits_are_disjoint():
    train, evaluation, probe = (
        [json.loads(x) for x in p.read_text().splitlines()] for p in (TRAIN_FILE, EVAL_FILE, PROBE_FILE)
    )
    assert (len(train), len(evaluation), len(probe)) == (2000, 200, 50)
    assert all(set(r) == {"id", "prompt"} for r in train)  # nothing a reward could read an answer from
    # 49 + 12 = 61: the labelled rows hold the true sum of the prompt's operands
    for r in evaluation + probe:
        a, b = (int(x) for x in r["prompt"].split("Compute ")[1].split(".")[0].split(" + "))
        assert r["answer"] == str(a + b)
    prompts = [{r["prompt"] for r in rows} for rows in (train, evaluation, probe)]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])


def test_unlabeled_preset_reads_no_answers_for_its_reward():
    cfg = get_preset("smollm2-arith-unlabeled").validate()
    r = cfg.reward
    assert r.label_free and r.aggregate == "ensemble" and cfg.data.source == str(TRAIN_FILE)
    assert not set(r.verifiers) & set(CORRECTNESS)  # no verifier that compares with a reference answer
    assert cfg.data.eval_source == str(EVAL_FILE) and cfg.eval.verifiers == ["math_answer"]
    assert cfg.collapse.probe_source == str(PROBE_FILE) and cfg.collapse.action == "rollback"
