"""Tests for forge.checkpoint (atomic save, resume pieces, retention) and forge.tracking (metrics.jsonl)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from forge.checkpoint import (
    STATE_FILE,
    apply_retention,
    latest_checkpoint,
    load_state,
    load_weights,
    save_checkpoint,
    set_rng_state,
    step_dir_name,
)
from forge.io import atomic_write_text, write_json
from forge.models import build_char_tokenizer, build_tiny_model
from forge.tracking import JsonlTracker, read_metrics


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def model(tok):
    return build_tiny_model(tok, hidden=32, layers=1, seed=0)


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ---------------------------------------------------------------- save / load


def test_save_writes_dir_and_latest_pointer(tmp_path: Path, model, tok):
    root = tmp_path / "checkpoints"
    ckpt = save_checkpoint(root, 3, model, tok, {"sampler": {"cursor": 7}}, eval_score=0.25)
    assert ckpt == root / "step-000003" and ckpt.name == step_dir_name(3)
    assert entries(root) == ["latest", "step-000003"]  # no temp dirs or temp pointer files left behind
    assert (root / "latest").read_text() == "step-000003\n"
    assert latest_checkpoint(root) == ckpt
    assert {"config.json", "model.safetensors", STATE_FILE, "checkpoint.json"} <= set(entries(ckpt))
    assert json.loads((ckpt / "checkpoint.json").read_text()) == {"step": 3, "eval_pass@1": 0.25}
    state = load_state(ckpt)
    assert state["sampler"] == {"cursor": 7} and state["step"] == 3 and state["eval_score"] == 0.25


def test_latest_moves_to_newest_save(tmp_path: Path, model, tok):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, tok, {})
    save_checkpoint(root, 2, model, tok, {})
    assert latest_checkpoint(root) == root / "step-000002"
    assert entries(root) == ["latest", "step-000001", "step-000002"]


def test_resave_same_step_replaces_it(tmp_path: Path, model, tok):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, tok, {"v": 1})
    save_checkpoint(root, 1, model, tok, {"v": 2})
    assert load_state(root / "step-000001")["v"] == 2
    assert entries(root) == ["latest", "step-000001"]


def test_latest_checkpoint_none_without_pointer_or_state(tmp_path: Path):
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(root) is None
    (root / "step-000001").mkdir(parents=True)
    atomic_write_text(root / "latest", "step-000001\n")
    assert latest_checkpoint(root) is None  # the pointer names a directory without trainer_state.pt


def test_load_weights_restores_parameters_into_fresh_model(tmp_path: Path, model, tok):
    with torch.no_grad():  # move off init so a re-init could not pass by accident
        for p in model.parameters():
            p.add_(0.01)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, model, tok, {})
    other = build_tiny_model(tok, hidden=32, layers=1, seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    params_before = {n: p for n, p in other.named_parameters()}
    load_weights(other, ckpt)
    want = model.state_dict()
    got = other.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # weights are copied in place (the optimizer holds these Parameter objects) and the head stays tied
    assert all(p is params_before[n] for n, p in other.named_parameters())
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()


def test_rng_state_round_trip(tmp_path: Path, model, tok):
    torch.manual_seed(123)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, model, tok, {})
    drawn = (torch.rand(4), random.random(), np.random.rand())
    torch.rand(10), random.random(), np.random.rand(3)  # the run goes on, then crashes
    set_rng_state(load_state(ckpt)["rng"])
    again = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(again[0], drawn[0]) and again[1:] == drawn[1:]


@pytest.mark.parametrize("target", ["model", "tokenizer"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, model, tok, monkeypatch, target):
    root = tmp_path / "checkpoints"
    good = save_checkpoint(root, 1, model, tok, {"v": 1})

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(model if target == "model" else tok, "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(root, 2, model, tok, {"v": 2})
    assert entries(root) == ["latest", "step-000001"]  # no step-000002, no half-written temp dir
    assert latest_checkpoint(root) == good
    assert load_state(good)["v"] == 1


# ---------------------------------------------------------------- retention (fake checkpoints, no model)


def fake_checkpoints(root: Path, scores: dict[int, float | None]) -> None:
    for step, score in scores.items():
        d = root / step_dir_name(step)
        d.mkdir(parents=True)
        (d / STATE_FILE).write_bytes(b"")
        write_json(d / "checkpoint.json", {"step": step, "eval_pass@1": score})
    atomic_write_text(root / "latest", step_dir_name(max(scores)) + "\n")


SCORES = {1: 0.2, 2: 0.9, 3: None, 4: 0.5, 5: 0.1, 6: None}


def steps_left(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def test_retention_keeps_last_and_best(tmp_path: Path):
    fake_checkpoints(tmp_path, SCORES)
    # keep_last=2 -> 5, 6; keep_best=1 -> 2 (0.9); unscored ones (3, 6) never count as best.
    removed = apply_retention(tmp_path, keep_last=2, keep_best=1)
    assert steps_left(tmp_path) == [2, 5, 6]
    assert sorted(p.name for p in removed) == ["step-000001", "step-000003", "step-000004"]


def test_retention_keep_best_two(tmp_path: Path):
    fake_checkpoints(tmp_path, SCORES)
    apply_retention(tmp_path, keep_last=1, keep_best=2)  # last: 6; best: 2 (0.9), 4 (0.5)
    assert steps_left(tmp_path) == [2, 4, 6]


def test_retention_best_ties_keep_the_earlier(tmp_path: Path):
    fake_checkpoints(tmp_path, {1: 0.5, 2: 0.5, 3: 0.1})
    apply_retention(tmp_path, keep_last=1, keep_best=1)
    assert steps_left(tmp_path) == [1, 3]


def test_retention_never_deletes_latest(tmp_path: Path):
    fake_checkpoints(tmp_path, SCORES)
    atomic_write_text(tmp_path / "latest", "step-000003\n")  # e.g. resumed from 3 while newer dirs remain
    apply_retention(tmp_path, keep_last=1, keep_best=1)
    assert steps_left(tmp_path) == [2, 3, 6]
    apply_retention(tmp_path, keep_last=0, keep_best=0)
    assert steps_left(tmp_path) == [3]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"


def test_retention_ignores_temp_dirs_and_files(tmp_path: Path):
    fake_checkpoints(tmp_path, {1: None, 2: None})
    (tmp_path / ".step-000003.abc").mkdir()  # an in-progress save
    apply_retention(tmp_path, keep_last=1, keep_best=0)
    assert entries(tmp_path) == [".step-000003.abc", "latest", "step-000002"]


def test_retention_with_real_saves(tmp_path: Path, model, tok):
    root = tmp_path / "checkpoints"
    for step, score in ((1, 0.8), (2, 0.1), (3, None), (4, 0.3)):
        save_checkpoint(root, step, model, tok, {}, eval_score=score)
        apply_retention(root, keep_last=1, keep_best=1)
    assert steps_left(root) == [1, 4]
    assert latest_checkpoint(root) == root / "step-000004"


# ---------------------------------------------------------------- metrics.jsonl


def test_jsonl_tracker_logs_and_truncates(tmp_path: Path):
    t = JsonlTracker(tmp_path)
    for step in range(1, 6):
        t.log_metrics({"reward/mean": step / 10, "train/kl": float("nan") if step == 2 else 0.0}, step)
    rows = read_metrics(t.path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[1]["train/kl"] is None  # non-finite -> null, the file stays valid JSON
    t.truncate_after(3)
    assert [r["step"] for r in read_metrics(t.path)] == [1, 2, 3]
    assert read_metrics(t.path)[2] == {"step": 3, "reward/mean": 0.3, "train/kl": 0.0}


def test_truncate_after_without_file_is_noop(tmp_path: Path):
    t = JsonlTracker(tmp_path)
    t.truncate_after(3)
    assert not t.path.exists()


def test_read_metrics_skips_torn_last_line(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')  # killed mid-write
    assert read_metrics(path) == [{"step": 1, "a": 1}, {"step": 2, "a": 2}]


def test_truncate_after_repairs_torn_line_before_appending(tmp_path: Path):
    # A resume truncates first; without that the next row would be glued onto the torn text and lost.
    t = JsonlTracker(tmp_path)
    t.path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    t.truncate_after(2)
    t.log_metrics({"a": 3}, 3)
    assert read_metrics(t.path) == [{"step": 1, "a": 1}, {"step": 2, "a": 2}, {"step": 3, "a": 3}]
    assert t.path.read_text().endswith("\n")
