"""Trackers: where params, metrics and artifacts go. The recipe only sees the `Tracker` protocol.

`JsonlTracker` writes `metrics.jsonl` (one JSON object per step, plus one per checkpoint, for its step, once it is
durable; `read_metrics` merges them) in the run directory; `NullTracker`
drops everything; `MultiTracker` fans out. `forge.tracking_mlflow.MlflowTracker` implements the same protocol
(mlflow is imported only there, and only when it sends), as do the optional `forge.tracking_tensorboard` and
`forge.tracking_wandb` (their packages imported only when on). `trackers_for_run` builds what `tracking.*` turns
on. Trackers must never raise into the training loop: the optional ones go through a `Guard`, whose first caught
error prints one warning line and turns that tracker off for the rest of the run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from forge.io import atomic_write_text


class Tracker(Protocol):
    def log_params(self, params: dict) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str = "") -> None:
        """A file (or directory) of the run directory, stored under `artifact_path` in the tracker."""

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        """Rows of one step (e.g. rollout samples) as a table `<name>/step-NNNNNN`."""

    def register_checkpoint(self, path: Path, step: int, eval_score: float | None) -> None:
        """A checkpoint directory: stored, and registered as a model version with its lineage."""

    def info(self) -> dict:
        """Facts for summary.json (e.g. {"mlflow_run_id": ...})."""

    def finish(self, status: str) -> None: ...


class NullTracker:
    def log_params(self, params: dict) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: str = "") -> None:
        pass

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        pass

    def register_checkpoint(self, path: Path, step: int, eval_score: float | None) -> None:
        pass

    def info(self) -> dict:
        return {}

    def finish(self, status: str) -> None:
        pass


class JsonlTracker(NullTracker):
    """Appends `{"step": s, ...metrics}` lines to run_dir/metrics.jsonl (non-finite values become null)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (they belong to work a resume will redo)."""
        if not self.path.exists():
            return
        rows = read_metrics(self.path, strict=True)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= step))


def read_metrics(path: Path, strict: bool = False) -> list[dict]:
    """Read metrics.jsonl, one row per step: rows of the same step are merged in file order (a checkpoint's
    record is a second row of its step, written when the save is durable); a torn last line (a run killed
    mid-write) is ignored. Other damaged lines (not UTF-8, not a JSON object with an integer step) are skipped,
    or, with `strict` (a resume, which rewrites the file), a UserError naming the line."""
    from forge.errors import UserError

    rows: dict = {}
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            ok = isinstance(row, dict) and isinstance(row.get("step"), int)
        except ValueError:
            ok = False
        if not ok:
            if strict and n < len(lines) - (lines[-1] == b""):
                raise UserError(f"{path}: line {n} is not a metrics row (a JSON object with an integer step); "
                                "the file is damaged: repair or delete that line, then --resume")  # fmt: skip
            continue
        rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return list(rows.values())


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MultiTracker(NullTracker):
    def __init__(self, *trackers: Tracker):
        self.trackers = trackers

    def log_params(self, params: dict) -> None:
        for t in self.trackers:
            t.log_params(params)

    def set_tags(self, tags: dict[str, str]) -> None:
        for t in self.trackers:
            t.set_tags(tags)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_artifact(self, path: Path, artifact_path: str = "") -> None:
        for t in self.trackers:
            t.log_artifact(path, artifact_path)

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        for t in self.trackers:
            t.log_table(name, step, rows)

    def register_checkpoint(self, path: Path, step: int, eval_score: float | None) -> None:
        for t in self.trackers:
            t.register_checkpoint(path, step, eval_score)

    def info(self) -> dict:
        out: dict = {}
        for t in self.trackers:
            out.update(t.info())
        return out

    def finish(self, status: str) -> None:
        for t in self.trackers:
            t.finish(status)


class Guard:
    """Runs a tracker's calls; the first exception prints one warning line and turns the tracker off (training
    goes on: tracking must never stop it)."""

    def __init__(self, name: str):
        self.name, self.off = name, False

    def __call__(self, fn: Callable, *args) -> None:
        if self.off:
            return
        try:
            fn(*args)
        except Exception as e:
            self.off = True
            print(f"forgeweave: warning: {self.name} tracking stopped for this run: {type(e).__name__}: {e}",
                  file=sys.stderr)  # fmt: skip


def require_package(package: str, key: str) -> None:
    """A UserError (before any training) when `key` turns on a tracker whose package is not installed."""
    from forge.errors import UserError

    if importlib.util.find_spec(package) is None:
        raise UserError(f"{key}=true needs the {package} package: pip install 'forgeweave[{package}]' (or turn it off)")


def trackers_for_run(cfg, run_dir: Path, tags: dict[str, str] | None = None) -> Tracker | None:
    """The trackers `tracking.*` turns on besides metrics.jsonl: MLflow, TensorBoard, W&B (None when none is)."""
    from forge.tracking_mlflow import tracker_for_run

    t = cfg.tracking
    found: list[Tracker] = []
    if (mlflow := tracker_for_run(cfg, run_dir, tags)) is not None:
        found.append(mlflow)
    if t.tensorboard:
        from forge.tracking_tensorboard import TensorBoardTracker

        require_package("tensorboard", "tracking.tensorboard")
        found.append(TensorBoardTracker(Path(run_dir) / "tensorboard"))
    if t.wandb:
        from forge.tracking_wandb import WandbTracker

        require_package("wandb", "tracking.wandb")
        found.append(WandbTracker(Path(run_dir), t.wandb_project, t.wandb_mode, tags or {}))
    return None if not found else found[0] if len(found) == 1 else MultiTracker(*found)
