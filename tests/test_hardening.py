"""Hardening of the library: config numbers, bounded parsing, verifier budget and ranges, non-finite steps and
checkpoints, the run-directory lock and stale status, pointers, the fitted ensemble across a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from forge.config import ConfigError, RunConfig, apply_overrides
from forge.errors import UserError
from forge.rewards.ensemble import RewardEnsembleConfig

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- config numbers


@pytest.mark.parametrize(
    "override, key",
    [
        ("update.lr=inf", "update.lr"),
        ("update.lr=.nan", "update.lr"),
        ("update.lr=0", "update.lr"),
        ("update.weight_decay=nan", "update.weight_decay"),
        ("update.weight_decay=-0.1", "update.weight_decay"),
        ("reward.weights=[nan]", "reward.weights[0]"),
        ("reward.weights=[1e400]", "reward.weights[0]"),
        ("update.adam_betas=[0.9, 1.0]", "update.adam_betas[1]"),
        ("update.adam_betas=[-0.1, 0.99]", "update.adam_betas[0]"),
        ("update.adam_betas=[0.9]", "update.adam_betas"),
        ("update.adaptive.target=0", "update.adaptive.target"),
        ("update.max_grad_norm=-1", "update.max_grad_norm"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("eval.temperature=0", "eval.temperature"),
        ("algo.is_cap=nan", "algo.is_cap"),
        ("seed=-1", "seed"),
        ("rollout.prompts_per_step=-3", "rollout.prompts_per_step"),
        ("data.train_size=-5", "data.train_size"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
        ("eval.every=-1", "eval.every"),
        ("eval.max_problems=0", "eval.max_problems"),
        ("update.max_skipped_steps=0", "update.max_skipped_steps"),
        ("reward.score_timeout_s=-1", "reward.score_timeout_s"),
    ],
)
def test_bad_numbers_are_one_line_config_errors_naming_the_key(override, key):
    cfg = apply_overrides(RunConfig(), [override])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    assert f"'{key}'" in msg and "\n" not in msg, msg


def test_valid_edge_values_pass():
    cfg = apply_overrides(RunConfig(), ["update.adam_betas=[0.0, 0.999]", "update.max_grad_norm=0", "seed=0"])
    assert cfg.validate() is cfg


# ---------------------------------------------------------------- bounded parsing, strict JSON


@pytest.mark.parametrize("answer", ["1e999999999", "1E-999999999", "1e999999999/3", "9" * 100_000, "2" + "0" * 5000])
def test_huge_numbers_are_compared_quickly(answer):
    from forge.rewards.math import answers_match
    from forge.rewards.verifiers import math_answer

    t0 = time.perf_counter()
    assert not answers_match(answer, "5")
    assert answers_match(answer, answer)  # as text
    assert math_answer(["q"], [f"the answer is {answer}"], answer=["5"]) == [0.0]
    assert time.perf_counter() - t0 < 30  # unbounded, the first one alone takes hours


def test_small_exponents_still_compare_as_numbers():
    from forge.rewards.math import answers_match

    assert answers_match("2e3", "2000") and answers_match("1.5E-2", "0.015")


@pytest.mark.parametrize(
    "text, why",
    [('{"a": 1, "a": 2}', "duplicate key 'a'"), ('{"answer": Infinity}', "Infinity"), ('{"x": NaN}', "NaN")],
)
def test_strict_json_refuses_what_json_accepts(text, why):
    from forge.data import strict_json_loads

    assert json.loads(text)  # the standard module takes it silently
    with pytest.raises(ValueError, match=why):
        strict_json_loads(text)


# ---------------------------------------------------------------- verifiers: range, overflow, time budget


def test_scores_beyond_float32_are_failures_and_rewards_stay_finite():
    from forge.rewards.score import score_completions

    def huge(prompts, completions, **kw):
        return [1e39, 3e38, float("nan"), 1.0]

    res = score_completions([("huge", huge)], [10.0], ["q"] * 4, ["a", "b", "c", "d"], {})
    assert res.failures["huge"] == 2  # 1e39 (inf in float32) and nan
    # 3e38 * 10 overflows float32: that reward is 0, not inf; the others are 0 (failed) and 10
    assert res.rewards.tolist() == [0.0, 0.0, 0.0, 10.0]
    assert torch.isfinite(res.rewards).all()


def test_a_hung_verifier_is_cut_off_with_an_error_naming_it():
    from forge.rewards.score import VerifierTimeout, score_completions

    def hangs(prompts, completions, **kw):
        time.sleep(30)
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    with pytest.raises(VerifierTimeout, match=r"verifier 'hangs' did not finish .* reward.score_timeout_s=0.5s"):
        score_completions([("hangs", hangs)], None, ["q"], ["a"], {}, timeout_s=0.5)
    assert time.perf_counter() - t0 < 5


def test_verifier_errors_inside_the_budget_are_still_per_item_failures():
    from forge.rewards.score import score_completions

    def picky(prompts, completions, **kw):
        if len(completions) > 1:
            raise ValueError("one at a time")
        return [None if completions[0] == "b" else 1.0]

    res = score_completions([("picky", picky)], None, ["q"] * 2, ["a", "b"], {}, timeout_s=5)
    assert res.failures["picky"] == 1 and res.rewards.tolist() == [1.0, 0.0]


# ---------------------------------------------------------------- non-finite steps and checkpoints


def _trainer(tok, **update):
    from forge.models import build_tiny_model
    from tests.grpo_parts import Trainer
    from tests.test_trainer import make_cfg

    return Trainer(build_tiny_model(tok, hidden=32, layers=1, seed=0), make_cfg(**update), total_steps=10)


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()}


def test_nan_advantages_skip_the_step_and_leave_weights_and_adam_untouched(tok):
    """A reward that turned into NaN advantages (or any NaN loss): no optimizer step, counted as skipped."""

    from tests.test_trainer import make_batch

    tr = _trainer(tok)
    tr.update(*make_batch(tok))  # one good step: AdamW has moments
    before, moments = _params(tr), {k: dict(v) for k, v in tr.optimizer.state_dict()["state"].items()}
    batch = make_batch(tok)
    bad = batch._replace(advantages=torch.full_like(batch.advantages, float("nan")))
    stats = tr.update(*bad)
    assert stats.skipped == 1 and not math.isfinite(stats.loss)
    after = _params(tr)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for k, state in tr.optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[k]["exp_avg"])
    good = tr.update(*make_batch(tok))  # training goes on from the last finite weights
    assert good.skipped == 0 and all(torch.isfinite(v).all() for v in _params(tr).values())


def test_an_infinite_gradient_skips_the_step(tok):
    from tests.test_trainer import make_batch

    tr = _trainer(tok, num_iterations=2)
    before = _params(tr)
    first = next(p for p in tr.model.parameters() if p.requires_grad)
    handle = first.register_hook(lambda g: torch.full_like(g, float("inf")))
    stats = tr.update(*make_batch(tok))
    handle.remove()
    assert stats.skipped == 2 and not math.isfinite(stats.grad_norm)  # both PPO passes skipped
    assert all(torch.equal(before[k], v) for k, v in _params(tr).items())


def test_a_checkpoint_with_a_nan_is_refused_and_latest_stays(tok, tmp_path):
    from forge.checkpoint import latest_checkpoint
    from forge.models import build_tiny_model
    from tests.grpo_parts import TrainerWorker
    from tests.test_trainer import make_cfg

    w = TrainerWorker(make_cfg(), model=build_tiny_model(tok, hidden=32, layers=1, seed=0), tokenizer=tok)
    root = tmp_path / "checkpoints"
    w.save(str(root), 1, {}, None)
    w.wait_saved()
    with torch.no_grad():
        next(w.trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(UserError, match=r"refusing to write checkpoint step-000002 .* not finite") as e:
        w.save(str(root), 2, {}, None)
    assert "\n" not in str(e.value)
    assert latest_checkpoint(root).name == "step-000001"
    assert not (root / "step-000002").exists() and not (root / ".step-000002.partial").exists()


def test_too_many_skipped_steps_in_a_row_stop_the_run():
    from forge.loop import Limits, LoopState, stop_reason, update_streak
    from forge.records import ScoredBatch, UpdateStats

    batch = ScoredBatch(["v"], torch.ones(2, 1), torch.ones(2), torch.zeros(2), {"v": 0})
    skipped = UpdateStats(*([0.0] * 8), tokens=1, seconds=0.0, policy_version=1, skipped=1)
    ok = UpdateStats(*([0.0] * 8), tokens=1, seconds=0.0, policy_version=1)
    state, cfg = LoopState(), RunConfig()
    limits = Limits(cfg.reward.max_failing_steps, cfg.update.max_skipped_steps)
    for step, stats in enumerate([skipped, skipped, ok, skipped, skipped], start=1):  # a good step resets the count
        state = update_streak(dataclasses.replace(state, step=step), stats)
        assert stop_reason(state, batch, limits) == ""
    state = update_streak(dataclasses.replace(state, step=6), skipped)
    assert re.match(r"step 6: 3 updates in a row .*\(update.max_skipped_steps=3\)", stop_reason(state, batch, limits))


# ---------------------------------------------------------------- lock, status, names, pointers


HOLD = """
import sys, time
from pathlib import Path
from forge.rundir import RunLock, write_status
lock = RunLock.acquire(Path(sys.argv[1]))
write_status(Path(sys.argv[1]), "running", step=3)
print("locked", flush=True)
time.sleep(120)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_second_process_is_refused_naming_the_live_pid_and_a_killed_one_is_stale(tmp_path):
    from forge.rundir import RunLock, run_status

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    holder = _holder(run_dir)
    try:
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        with pytest.raises(UserError) as e:
            RunLock.acquire(run_dir)
        msg = str(e.value)
        assert f"in use by process {holder.pid}" in msg and "\n" not in msg
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # the refused one wrote nothing
        status = run_status(run_dir)
        assert status["state"] == "running" and status["pid"] == holder.pid and not status["stale"]
        assert status["host"] and status["heartbeat"] > 0
    finally:
        holder.kill()
        holder.wait()
    status = run_status(run_dir)  # SIGKILL: status.json still says running, nobody holds the lock
    assert status["state"] == "running" and status["stale"]
    lock = RunLock.acquire(run_dir)  # and the directory can be taken over
    assert RunLock.acquire(run_dir) is lock  # re-entrant in one process
    lock.release()
    lock.release()


def test_the_heartbeat_never_writes_running_back_over_failed(tmp_path, monkeypatch):
    """A run stopped (SIGTERM) between the heartbeat's read of the last status and its write: status.json must end
    "failed", not the "running" the heartbeat had read (seen in CI under load: a stopped run left "running")."""
    import threading

    import forge.rundir as rd

    read, wrote = threading.Event(), threading.Event()

    class Racing(dict):  # the heartbeat's first read of "running" waits for the run to write "failed"
        armed = True

        def get(self, key, default=None):
            value = super().get(key, default)
            if self.armed and value is not None and value["state"] == "running":
                self.armed = False
                read.set()
                wrote.wait(2.0)  # the fixed heartbeat holds the lock here: the failed write waits for it instead
            return value

    monkeypatch.setattr(rd, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(rd, "_last_status", Racing())
    lock = rd.RunLock.acquire(tmp_path)
    try:
        rd.write_status(tmp_path, "running", step=3)
        assert read.wait(10)
        rd.write_status(tmp_path, "failed", step=3, error="SystemExit: 143")
        wrote.set()
        time.sleep(0.2)  # more beats: none may write
        assert json.loads((tmp_path / "status.json").read_text())["state"] == "failed"
    finally:
        lock.release()


@pytest.mark.parametrize("name", ["../x", "/abs/run", "a/b", "..", ".hidden", "", "a\\b"])
def test_run_names_must_be_one_plain_component(name):
    from forge.rundir import check_run_name

    with pytest.raises(UserError, match="is not a plain directory name"):
        check_run_name(name)


@pytest.mark.parametrize("pointer", ["../../etc", "/tmp/x", "step-1", "step-000001/../../x", "\xff"])
def test_latest_must_name_a_step_directory_beside_it(tmp_path, pointer):
    from forge.checkpoint import latest_checkpoint

    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_bytes(pointer.encode("latin-1"))
    with pytest.raises(UserError, match="not a checkpoint directory step-NNNNNN beside it"):
        latest_checkpoint(root)


def test_eval_output_is_a_json_file_in_an_existing_directory(tmp_path):
    from flows.evaluation import eval_output

    assert eval_output(tmp_path / "r.json") == tmp_path / "r.json"
    (tmp_path / "metrics.json").write_text('{"step": 1}')
    for bad, why in [
        (tmp_path / "r.txt", "ending in .json"),
        (tmp_path / "nope" / "r.json", "does not exist"),
        (tmp_path / "metrics.json", "is not an eval report"),
    ]:
        with pytest.raises(UserError, match=why):
            eval_output(bad)
    (tmp_path / "old.json").write_text('{"problems": 3, "pass@1": 0.5}')
    assert eval_output(tmp_path / "old.json")


# ---------------------------------------------------------------- the fitted ensemble travels in the checkpoint


@pytest.mark.parametrize("model", ["gaussian", "latent_class"])
def test_a_restored_aggregator_predicts_like_the_uninterrupted_one(model):
    """refit_every=4: the ensemble fit at step 1 scores steps 2-3. Restored after step 2 (through the checkpoint
    codec: JSON + safetensors), step 3 gets the same rewards; refitting on resume would not."""
    from safetensors.torch import load, save

    from forge.checkpoint import encode_state, join_tensors
    from forge.rewards.aggregate import EnsembleAggregator
    from tests.test_latent_class import make_checks

    names = ["parity", "mod3", "mod5", "digits"]

    def batch(step):
        scores, _, _ = make_checks(n=256, correct=0.2, malformed=0.3, seed=step)
        return torch.tensor(scores, dtype=torch.float32)

    def agg():
        return EnsembleAggregator(
            names, RewardEnsembleConfig(window_steps=8, refit_every=4, model=model, classes=3), seed=0
        )

    straight = agg()
    for step in (1, 2):
        straight(batch(step), 16, step)
    text, tensors = encode_state({"aggregator": straight.state_dict()})
    state = join_tensors(json.loads(text), load(save(tensors)))
    resumed = agg()
    resumed.load_state_dict(state["aggregator"])
    want, _ = straight(batch(3), 16, 3)
    got, report = resumed(batch(3), 16, 3)
    assert report is None  # no refit on resume
    assert torch.equal(want, got)
    refit = agg()
    refit.load_state_dict({**state["aggregator"], "model": None})  # what an older checkpoint gives
    assert not torch.equal(want, refit(batch(3), 16, 3)[0])
    assert np.isfinite(got.numpy()).all()


@pytest.mark.parametrize("mask, mode", [(0o077, 0o600), (0o022, 0o644)])
def test_run_files_keep_the_users_umask(tmp_path, mask, mode):
    """Atomic writes (config, eval reports, checkpoints' JSON) and appends (metrics) get what a plain `open` would
    under the user's umask: 0600 under 077, where they were forced to 0644 (readable by every local user)."""
    script = (
        "import os, sys; os.umask(int(sys.argv[2], 8)); from pathlib import Path; from forge.io import "
        "append_text, write_json; d = Path(sys.argv[1]); write_json(d / 'a.json', {}); append_text(d / 'b.jsonl', 'x')"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path), oct(mask)[2:]], check=True)
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {"a.json": mode, "b.jsonl": mode}
