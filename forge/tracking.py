"""Trackers: where params, metrics and artifacts go. The recipe only sees the `Tracker` protocol.

`JsonlTracker` writes `metrics.jsonl` (one JSON object per step, plus one per checkpoint, for its step, once it is
durable; `read_metrics` merges them) in the run directory; `NullTracker` drops everything; `MultiTracker` fans out.
That is all forge has: MLflow (with its outbox), TensorBoard and W&B implement the same protocol in
`flows.tracking`, whose `trackers_for_run` builds what `tracking.*` turns on, so forge never imports a tracking
package. The recipe and `forge.train` take them as `tracker=`. A tracker must never raise into the training
loop.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

from forge.io import append_text, read_retrying, truncate_jsonl


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
        append_text(self.path, json.dumps(row) + "\n")  # a full disk: one line, no half row left

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (they belong to work a resume will redo) and a torn last line; every line
        kept is byte for byte what was written, and a file with nothing to drop is not rewritten."""
        if self.path.exists():
            read_metrics(self.path, strict=True)  # a damaged line (but a torn last one) is a one-line error
            truncate_jsonl(self.path, step)


def read_metrics(path: Path, strict: bool = False) -> list[dict]:
    """Read metrics.jsonl, one row per step: rows of the same step are merged in file order (a checkpoint's
    record is a second row of its step, written when the save is durable); a torn last line (a run killed
    mid-write) is ignored. Other damaged lines (not UTF-8, not a JSON object with an integer step) are skipped,
    or, with `strict` (a resume, which rewrites the file), a UserError naming the line; with `strict` a read the
    storage fails is tried again (`forge.io.read_retrying`), then a StorageError."""
    from forge.errors import UserError

    rows: dict = {}
    lines = (read_retrying(path, path.read_bytes) if strict else path.read_bytes()).split(b"\n")
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
