"""TensorBoard and W&B trackers (read back with tensorboard's reader and wandb's offline records) and a resume with
overrides that rewrites config.yaml and records its changes (issue 13, acceptance 4 and 5)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from flows.cli import main
from flows.tracking import require_package, trackers_for_run
from flows.tracking.tensorboard_tracker import TensorBoardTracker
from flows.tracking.wandb_tracker import WandbTracker
from forge.checkpoint import latest_checkpoint, load_state
from forge.compose import resume_changes
from forge.config import RunConfig, load_yaml
from forge.errors import UserError
from forge.tracking import MultiTracker, read_metrics

os.environ.setdefault("WANDB_SILENT", "true")  # offline in every test; nothing here may reach the network
os.environ.setdefault("WANDB_MODE", "offline")


def tb_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard itself reads the event files (restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tb_texts(log_dir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def wandb_records(path: Path):
    """The protobuf records of an offline `.wandb` file: a 7-byte header, then LevelDB-log framing (32 KiB blocks;
    each chunk: crc32c, little-endian length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, parts = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts, pos = parts + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """(step -> merged history values, config) over every offline W&B directory of a run, in order."""
    history: dict[int, dict] = {}
    config: dict = {}
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                history.setdefault(row["step"], {}).update(row)
            elif kind in ("config", "run"):
                for u in (r.config if kind == "config" else r.run.config).update:
                    config["/".join(u.nested_key) or u.key] = json.loads(u.value_json)
    return history, config


# ---------------------------------------------------------------- the trackers alone


def test_tensorboard_scalars_texts_and_a_resumed_writer_purging_redone_steps(tmp_path):
    first = TensorBoardTracker(tmp_path / "tb")
    first.set_tags({"forgeweave.preset": "tiny"})
    first.log_params({"update.lr": 0.001})
    for step in range(6):
        first.log_metrics({"reward/mean": step / 10, "train/kl_ref": None, "eval/pass@1": 0.5}, step)
    first.log_metrics({"time/checkpoint_s": 1.5}, 2)  # a checkpoint's record arrives after later steps
    first.finish("KILLED")
    # a resumed process from checkpoint 2: steps 3.. again, with other values; what the first logged there goes
    second = TensorBoardTracker(tmp_path / "tb")
    second.log_params({"update.lr": 0.001})
    for step in (3, 4):
        second.log_metrics({"reward/mean": 1 + step / 10}, step)
    second.finish("FINISHED")
    scalars = tb_scalars(tmp_path / "tb")
    assert scalars["reward/mean"] == pytest.approx({0: 0.0, 1: 0.1, 2: 0.2, 3: 1.3, 4: 1.4})
    assert scalars["time/checkpoint_s"] == {2: 1.5}
    assert set(scalars) == {"reward/mean", "eval/pass@1", "time/checkpoint_s"}  # None is not a scalar
    texts = tb_texts(tmp_path / "tb")
    assert "| forgeweave.preset | tiny |" in texts["tags/text_summary"][0]
    assert "| update.lr | 0.001 |" in texts["config/text_summary"][0]


def test_a_failing_tracker_warns_once_and_never_raises(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    t = TensorBoardTracker(tmp_path / "file" / "tb")
    for step in range(3):
        t.log_metrics({"reward/mean": 1.0}, step)
    t.finish("FINISHED")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("forgeweave: warning: TensorBoard tracking stopped for this run")


def test_a_tracker_without_its_package_is_a_one_line_error():
    with pytest.raises(UserError, match=r"tracking.wandb=true needs the nosuchpkg package: pip install"):
        require_package("nosuchpkg", "tracking.wandb")


def test_trackers_for_run_builds_what_tracking_turns_on(tmp_path):
    cfg = RunConfig()
    cfg.tracking.mlflow = False
    assert trackers_for_run(cfg, tmp_path) is None
    cfg.tracking.tensorboard = True
    assert isinstance(trackers_for_run(cfg, tmp_path), TensorBoardTracker)
    cfg.tracking.wandb = True
    both = trackers_for_run(cfg, tmp_path)
    assert isinstance(both, MultiTracker)
    assert [type(t) for t in both.trackers] == [TensorBoardTracker, WandbTracker]
    assert both.trackers[1].mode == "offline"  # the default: never online unless asked
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()  # nothing until used


# ---------------------------------------------------------------- a real run, then a resume with changes

RUN = [
    "steps=3", "threads=1", "checkpoint.every=2", "eval.every=0", "eval.k=0", "eval.max_problems=8",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "update.adaptive.enabled=false",
    "tracking.mlflow=false", "tracking.tensorboard=true", "tracking.wandb=true",
]  # fmt: skip


def _run(runs_dir: Path, *args: str) -> int:
    return main(["run", "--name", "r", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect", *args])


def _sets(items) -> list[str]:
    return [a for s in items for a in ("--set", s)]


@pytest.mark.slow
def test_resume_with_overrides_rewrites_config_records_changes_and_trackers_match_metrics(runs_dir, capsys):
    assert _run(runs_dir, "--preset", "tiny", *_sets(RUN)) == 0
    run = runs_dir / "r"
    before = {f: (run / f).read_bytes() for f in ("config.yaml", "metrics.jsonl", "status.json")}

    # a change the checkpoint cannot honour: one line naming the key, the run directory untouched
    capsys.readouterr()
    assert _run(runs_dir, "--resume", "--set", "steps=5", "--set", "seed=1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("forgeweave: error: config key 'seed' cannot change on --resume (0 -> 1)"), err
    assert "\n" not in err
    assert {f: (run / f).read_bytes() for f in before} == before and not (run / "config_changes.jsonl").exists()

    changes = ["steps=5", "update.lr=5e-4", "update.weight_decay=0.01", "eval.max_problems=4"]
    assert _run(runs_dir, "--resume", *_sets(changes)) == 0

    cfg = load_yaml(run / "config.yaml")  # rewritten with the new values
    assert (cfg.steps, cfg.update.lr, cfg.update.weight_decay, cfg.eval.max_problems) == (5, 5e-4, 0.01, 4)
    records = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 3 and records[0]["time"].endswith("Z")
    assert records[0]["changes"] == {
        "steps": [3, 5], "eval.max_problems": [8, 4], "update.lr": [0.001, 0.0005], "update.weight_decay": [0.0, 0.01]
    }  # fmt: skip
    assert resume_changes(run, cfg, latest_checkpoint(run / "checkpoints")) == {}  # resuming again: nothing new

    # the new values are what the resumed steps used (the saved optimizer settings did not win)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["train/lr"] for r in rows[1:]] == [1e-3, 1e-3, 1e-3, 5e-4, 5e-4]
    groups = load_state(run / "checkpoints" / "step-000005")["trainer"]["param_groups"]
    assert {g["weight_decay"] for g in groups} == {0.01}
    assert json.loads((run / "summary.json").read_text())["steps"] == 5

    # TensorBoard: every number of metrics.jsonl, at its step, as tensorboard's reader sees it
    scalars = tb_scalars(run / "tensorboard")
    logged = [(r["step"], k, v) for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))]
    assert len(logged) > 100
    for step, key, value in logged:
        assert scalars[key][step] == pytest.approx(value, rel=1e-6, abs=1e-6), (step, key)
    assert "forgeweave.config_changes.step-000003" in tb_texts(run / "tensorboard")["tags/text_summary"][-1]

    # W&B offline: one directory per process, the same run id, the history holds metrics.jsonl's numbers
    wandb_id = (run / "wandb_id").read_text().strip()
    dirs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and all(d.name.endswith(f"-{wandb_id}") for d in dirs)
    history, config = wandb_run(run)
    for step, key, value in logged:
        if math.isfinite(value):
            assert history[step][key] == pytest.approx(value, rel=1e-9), (step, key)
    assert config["update.lr"] == 0.001  # params: the config the run started with; the change is a tag
    assert json.loads(config["forgeweave.config_changes.step-000003"])["update.lr"] == [0.001, 0.0005]
    out = capsys.readouterr().out
    assert f"tensorboard: {run / 'tensorboard'}" in out and "wandb run:" in out
