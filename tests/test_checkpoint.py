"""Tests for forge.checkpoint (layout, no pickle, exact restore, asynchronous save, atomicity, retention) and
forge.tracking (metrics.jsonl).

Saves go through `forge.workers.TrainerWorker` in this process (one update process: the HF weights in
model.safetensors, AdamW's moments in the DCP shard `state/`), on the 1-layer tiny Llama of tests/test_trainer.py
trained on its hand-built batch.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import forge.checkpoint as ckpt_mod
from forge.checkpoint import (
    STATE_JSON,
    apply_retention,
    latest_checkpoint,
    load_state,
    load_weights,
    shard_keys,
    step_dir_name,
)
from forge.errors import UserError
from forge.io import atomic_write_text, write_json
from forge.models import build_tiny_model
from forge.tracking import JsonlTracker, read_metrics
from tests.grpo_parts import TrainerWorker
from tests.test_trainer import make_batch, make_cfg

torch.set_num_threads(1)


def worker(tok, async_save: bool = False, **update) -> TrainerWorker:
    cfg = make_cfg(**update)
    cfg.checkpoint.async_save = async_save
    return TrainerWorker(cfg, model=build_tiny_model(tok, hidden=32, layers=1, seed=0), tokenizer=tok)


def save(w: TrainerWorker, root: Path, step: int, payload: dict | None = None, score: float | None = None):
    w.save(str(root), step, payload or {}, score)
    return w.wait_saved()


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def weights_and_moments(w: TrainerWorker) -> dict[str, torch.Tensor]:
    flat, _ = w.trainer.checkpoint_tensors(with_model=True)
    return {k: v.detach().clone() for k, v in flat.items()}


# ---------------------------------------------------------------- layout, no pickle


def test_save_writes_dir_and_latest_pointer(tmp_path: Path, tok):
    root = tmp_path / "checkpoints"
    report = save(worker(tok), root, 3, {"sampler": {"cursor": 7}}, score=0.25)
    ckpt = root / "step-000003"
    assert report.path == str(ckpt) and report.step == 3 and ckpt.name == step_dir_name(3)
    assert entries(root) == ["latest", "step-000003"]  # no partial dirs or temp pointer files left behind
    assert (root / "latest").read_text() == "step-000003\n"
    assert latest_checkpoint(root) == ckpt
    files = {"config.json", "model.safetensors", STATE_JSON, "trainer_state.safetensors", "checkpoint.json", "state"}
    assert files <= set(entries(ckpt))
    info = json.loads((ckpt / "checkpoint.json").read_text())
    assert info["step"] == 3 and info["eval_pass@1"] == 0.25 and info["ranks"] == 1
    on_disk = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert report.bytes == on_disk  # checkpoint.json's own size included
    state = load_state(ckpt)
    assert state["sampler"] == {"cursor": 7} and state["step"] == 3 and state["eval_score"] == 0.25
    assert state["trainer"]["step"] == 0 and state["trainer"]["param_groups"][0]["lr"] == 1e-3
    # one process: the weights are in model.safetensors, the shards hold AdamW's moments only
    assert {k.split(".")[0] for k in shard_keys(ckpt)} == {"optim"}


def test_every_file_is_json_or_safetensors(tmp_path: Path, tok):
    """Nothing is pickled: each file parses as JSON or opens as safetensors, none starts with pickle's opcode."""
    ckpt = Path(save(worker(tok), tmp_path, 1, {"window": [np.arange(3.0)], "stream": torch.get_rng_state()}).path)
    for f in (p for p in ckpt.rglob("*") if p.is_file()):
        assert f.read_bytes()[:1] != b"\x80", f
        if f.suffix == ".safetensors":
            with safe_open(f, framework="pt") as st:
                assert list(st.keys()), f
        else:
            json.loads(f.read_text())
    state = load_state(ckpt)
    assert np.array_equal(state["window"][0], np.arange(3.0)) and torch.equal(state["stream"], torch.get_rng_state())


class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FORGEWEAVE_PLANTED']}",))


def test_a_planted_pickle_is_never_executed(tmp_path: Path, tok, monkeypatch):
    """Pickles planted where an older version (trainer_state.pt) or DCP (state/.metadata) kept one are ignored on
    restore; a directory with only the legacy pickle is refused with one line."""
    marker = tmp_path / "executed"
    monkeypatch.setenv("FORGEWEAVE_PLANTED", str(marker))
    ckpt = Path(save(worker(tok), tmp_path / "checkpoints", 1).path)
    for planted in (ckpt / "trainer_state.pt", ckpt / "state" / ".metadata", ckpt / "state" / "x.distcp"):
        planted.write_bytes(pickle.dumps(_Planted()))
    worker(tok).restore(str(ckpt))
    assert not marker.exists()
    old = tmp_path / "old" / "step-000001"
    old.mkdir(parents=True)
    (old / "trainer_state.pt").write_bytes(pickle.dumps(_Planted()))
    refused = r"has no trainer_state.json \(a pickled .* never loaded\): start the run again"
    with pytest.raises(UserError, match=refused) as e:
        load_state(old)
    assert "\n" not in str(e.value) and not marker.exists()


# ---------------------------------------------------------------- exact restore


@pytest.mark.parametrize("async_save", [False, True])
def test_restore_continues_exactly(tmp_path: Path, tok, async_save):
    """Train 2 steps, save, train a third; a fresh worker restored from the save and trained a third step holds
    the same weights and AdamW moments, bitwise, and the same LR controller, step and policy version."""
    a = worker(tok, async_save, adaptive=True, max_grad_norm=1.0)
    batch = make_batch(tok)
    a.step(*batch), a.step(*batch)
    ckpt = save(a, tmp_path, 2).path
    a.step(*batch)
    b = worker(tok, async_save, adaptive=True, max_grad_norm=1.0)
    assert b.restore(ckpt) == 2
    b.step(*batch)
    want, got = weights_and_moments(a), weights_and_moments(b)
    assert want.keys() == got.keys() and any(k.endswith(".exp_avg_sq") for k in want)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert b.trainer.adaptive.state_dict() == a.trainer.adaptive.state_dict() and b.trainer.step == 3


def test_load_weights_restores_parameters_into_fresh_model(tmp_path: Path, tok):
    w = worker(tok)
    w.step(*make_batch(tok))  # move off init so a re-init could not pass by accident
    ckpt = Path(save(w, tmp_path, 1).path)
    model = w.trainer.unwrapped
    other = build_tiny_model(tok, hidden=32, layers=1, seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    params_before = {n: p for n, p in other.named_parameters()}
    load_weights(other, ckpt)
    want, got = model.state_dict(), other.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # weights are copied in place (the optimizer holds these Parameter objects) and the head stays tied
    assert all(p is params_before[n] for n, p in other.named_parameters())
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()


def test_latest_moves_to_newest_save_and_a_resave_replaces(tmp_path: Path, tok):
    root, w = tmp_path / "checkpoints", worker(tok)
    save(w, root, 1), save(w, root, 2, {"v": 1}), save(w, root, 2, {"v": 2})
    assert latest_checkpoint(root) == root / "step-000002" and load_state(root / "step-000002")["v"] == 2
    assert entries(root) == ["latest", "step-000001", "step-000002"]


def test_latest_checkpoint_none_without_pointer_or_state(tmp_path: Path):
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(root) is None
    (root / "step-000001").mkdir(parents=True)
    atomic_write_text(root / "latest", "step-000001\n")
    assert latest_checkpoint(root) is None  # the pointer names a directory without trainer_state.json


# ---------------------------------------------------------------- asynchronous save, failures


def test_async_save_returns_before_the_write_and_keeps_the_snapshot(tmp_path: Path, tok, monkeypatch):
    """`save` returns while the writer is held; training goes on; the next save waits for the first (at most one
    in flight); the checkpoint holds the weights of the moment `save` was called, not the later ones."""
    release, real = threading.Event(), ckpt_mod.write_shards

    def held(*args, **kwargs):
        assert release.wait(30)
        real(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "write_shards", held)
    w, root, batch = worker(tok, async_save=True), tmp_path / "checkpoints", make_batch(tok)
    w.step(*batch)
    at_save = {k: v.clone() for k, v in w.trainer.unwrapped.state_dict().items()}
    w.save(str(root), 1, {}, None)  # returns with the write held: training continues
    w.step(*batch)
    assert latest_checkpoint(root) is None and (root / ".step-000001.partial").is_dir()
    second = threading.Thread(target=w.save, args=(str(root), 2, {}, None))
    second.start()
    time.sleep(0.3)
    assert second.is_alive()  # waits for save 1
    release.set()
    second.join(30)
    assert w.wait_saved().step == 2 and latest_checkpoint(root) == root / "step-000002"
    saved = ckpt_mod.read_weights(root / "step-000001")
    assert all(torch.equal(saved[k], at_save[k]) for k in saved)
    assert not torch.equal(saved["model.norm.weight"], w.trainer.unwrapped.state_dict()["model.norm.weight"])


def test_the_next_optimizer_step_waits_for_the_host_copy(tmp_path: Path, tok, monkeypatch):
    """The background copy overlaps the next update's forward/backward; its optimizer step (the first change of
    the state) waits for the copy, and that wait is reported as the save's stall."""
    release, real = threading.Event(), ckpt_mod.host_copy

    def slow_copy(tensors):
        assert release.wait(30)
        return real(tensors)

    monkeypatch.setattr(ckpt_mod, "host_copy", slow_copy)
    w, batch = worker(tok, async_save=True), make_batch(tok)
    w.step(*batch)
    before = {k: v.clone() for k, v in w.trainer.unwrapped.state_dict().items()}
    w.save(str(tmp_path), 1, {}, None)
    update = threading.Thread(target=w.step, args=batch)
    update.start()
    time.sleep(0.5)
    assert update.is_alive()  # forward/backward done, the optimizer step waits: the weights are still unchanged
    assert torch.equal(w.trainer.unwrapped.state_dict()["model.norm.weight"], before["model.norm.weight"])
    release.set()
    update.join(30)
    report = w.wait_saved()
    assert report.stall_seconds >= 0.4
    saved = ckpt_mod.read_weights(Path(report.path))
    assert all(torch.equal(saved[k], before[k]) for k in saved)


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_keeps_previous_checkpoint(tmp_path: Path, tok, monkeypatch, async_save):
    """A save that fails mid-write leaves `latest` on the previous checkpoint; in the background its error is
    raised by the next wait and by every later save (the run fails with it)."""
    root, w = tmp_path / "checkpoints", worker(tok, async_save)
    good = Path(save(w, root, 1, {"v": 1}).path)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "write_shards", boom)
    with pytest.raises(OSError, match="disk full"):
        save(w, root, 2, {"v": 2})
    if async_save:
        monkeypatch.undo()
        with pytest.raises(OSError, match="disk full"):
            save(w, root, 3)
    assert latest_checkpoint(root) == good and load_state(good)["v"] == 1
    assert [e for e in entries(root) if not e.startswith(".")] == ["latest", "step-000001"]


# ---------------------------------------------------------------- retention (fake checkpoints, no model)


def fake_checkpoints(root: Path, scores: dict[int, float | None]) -> None:
    for step, score in scores.items():
        d = root / step_dir_name(step)
        d.mkdir(parents=True)
        write_json(d / STATE_JSON, {})
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


def test_retention_with_real_saves(tmp_path: Path, tok):
    root, w = tmp_path / "checkpoints", worker(tok)
    for step, score in ((1, 0.8), (2, 0.1), (3, None), (4, 0.3)):
        save(w, root, step, score=score)
        apply_retention(root, keep_last=1, keep_best=1)
    assert steps_left(root) == [1, 4]
    assert latest_checkpoint(root) == root / "step-000004"


def test_retention_keeps_the_newest_intact_checkpoint_when_a_newer_one_is_damaged(tmp_path: Path, tok):
    """keep_last=1 after a save whose file was damaged on its way to disk: the damaged newest stays (`latest` names
    it; resume skips it with one line) and so does the newest intact one before it; only older ones go."""
    root, w = tmp_path / "checkpoints", worker(tok)
    for step in (1, 2, 3):
        save(w, root, step)
    weights = root / "step-000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    apply_retention(root, keep_last=1, keep_best=0)
    assert steps_left(root) == [2, 3]
    save(w, root, 4)
    apply_retention(root, keep_last=1, keep_best=0)  # step 4 is intact: 2 and 3 may go
    assert steps_left(root) == [4]


# ---------------------------------------------------------------- metrics.jsonl


def test_jsonl_tracker_logs_and_truncates(tmp_path: Path):
    t = JsonlTracker(tmp_path)
    for step in range(1, 6):
        t.log_metrics({"reward/mean": step / 10, "train/kl_ref": float("nan") if step == 2 else 0.0}, step)
    rows = read_metrics(t.path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[1]["train/kl_ref"] is None  # non-finite -> null, the file stays valid JSON
    t.truncate_after(3)
    assert [r["step"] for r in read_metrics(t.path)] == [1, 2, 3]
    assert read_metrics(t.path)[2] == {"step": 3, "reward/mean": 0.3, "train/kl_ref": 0.0}


def test_truncate_after_without_file_is_noop(tmp_path: Path):
    t = JsonlTracker(tmp_path)
    t.truncate_after(3)
    assert not t.path.exists()


def test_read_metrics_merges_a_checkpoint_row_into_its_step(tmp_path: Path):
    t = JsonlTracker(tmp_path)
    t.log_metrics({"a": 1}, 1), t.log_metrics({"a": 2}, 2), t.log_metrics({"time/checkpoint_s": 0.5}, 1)
    assert read_metrics(t.path) == [{"step": 1, "a": 1, "time/checkpoint_s": 0.5}, {"step": 2, "a": 2}]


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


# ---------------------------------------------------------------- run level: metrics, SIGKILL mid background save

KILL_RUN = """
import sys, time
import forge.checkpoint as c
from tests.test_checkpoint import small_run_cfg
from forge.recipes.grpo import run

real = c.write_shards

def held(path, shards, group=None):  # step 4's shards are written, then the writer never finishes
    real(path, shards, group)
    if "step-000004" in str(path):
        time.sleep(600)

c.write_shards = held
run(small_run_cfg(), __import__("pathlib").Path(sys.argv[1]), progress=False)
"""


def small_run_cfg():
    from forge.presets import tiny

    cfg = tiny()
    cfg.steps, cfg.threads, cfg.checkpoint.every, cfg.tracking.mlflow = 4, 1, 2, False
    cfg.eval.every, cfg.eval.k, cfg.eval.max_problems = 0, 0, 8
    cfg.rollout.prompts_per_step = 4
    return cfg


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    from forge.recipes.grpo import run

    d = tmp_path_factory.mktemp("straight") / "run"
    run(small_run_cfg(), d, progress=False)
    return d


def test_checkpoint_seconds_stall_and_bytes_are_recorded(straight_run):
    rows = {r["step"]: r for r in read_metrics(straight_run / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step in (2, 4):  # checkpoint.every=2 (and the last step)
        r = rows[step]
        assert 0 < r["time/checkpoint_stall_s"] <= r["time/checkpoint_s"]
        assert "train/loss" in r  # the checkpoint's row merged into its step's
    info = json.loads((straight_run / "checkpoints" / "step-000004" / "checkpoint.json").read_text())
    assert rows[4]["checkpoint/bytes"] == info["bytes"] + len(json.dumps(info, indent=2)) + 1
    summary = json.loads((straight_run / "summary.json").read_text())
    assert summary["checkpoint"] == {"async_save": True, "bytes": rows[4]["checkpoint/bytes"], "last": "step-000004"}
    assert summary["seconds"]["checkpoint_total"] >= summary["seconds"]["checkpoint_stall"] > 0


def test_sigkill_during_a_background_save_keeps_latest_and_resumes_exactly(straight_run, tmp_path):
    """The run is killed while step 4's save is being written in the background (its shards on disk, the rest
    not): `latest` still names step 2, complete; --resume redoes steps 3-4 and ends as the uninterrupted run."""
    import subprocess
    import sys

    from forge.recipes.grpo import run
    from tests.servers import REPO

    d = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    victim = subprocess.Popen([sys.executable, "-c", KILL_RUN, str(d)], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    partial = d / "checkpoints" / ".step-000004.partial" / "state"
    deadline = time.time() + 240
    while time.time() < deadline and victim.poll() is None and not list(partial.glob("*.safetensors")):
        time.sleep(0.05)
    assert victim.poll() is None, victim.stderr.read()[-2000:]
    victim.kill()
    victim.wait(timeout=30)
    root = d / "checkpoints"
    assert latest_checkpoint(root) == root / "step-000002" and not (root / "step-000004").exists()
    assert load_state(root / "step-000002")["step"] == 2
    run(small_run_cfg(), d, resume=True, progress=False)
    assert not (root / ".step-000004.partial").exists()  # the killed save's leftovers are removed on resume
    a = ckpt_mod.read_weights(straight_run / "checkpoints" / "step-000004")
    b = ckpt_mod.read_weights(root / "step-000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "checkpoint/"))}  # noqa: E731
    assert [keep(r) for r in read_metrics(d / "metrics.jsonl")] == [
        keep(r) for r in read_metrics(straight_run / "metrics.jsonl")
    ]
