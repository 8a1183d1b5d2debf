"""Weights & Biases as an optional tracker (`tracking.wandb`), offline unless `tracking.wandb_mode=online`.

`WandbTracker` implements `forge.tracking.Tracker`; wandb is imported only when the first record is sent. The W&B
run is named after the run directory and keeps its files in <run_dir>/wandb/ (offline:
`offline-run-<time>-<id>/run-<id>.wandb`, uploaded later with `wandb sync <that directory>`). Its id is kept in
<run_dir>/wandb_id, so a resume continues the same W&B run (`resume="allow"`; offline, each process writes a
directory of its own with that id). The params (the config) and the tags go into the run's config. Metrics are
logged with their forgeweave step as the `step` key, the x axis of every chart (`define_metric`): wandb's own step
may only grow, while a checkpoint's record arrives after later steps. wandb does not capture the console
(`console="off"`) and prints nothing (`silent`). Sample tables, artifacts and checkpoints are not sent (they stay in
the run directory and MLflow). An error (no login for online mode, say) turns the tracker off with one warning
(`flows.tracking.safe_calls.SafeCalls`); it never reaches the training loop.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from flows.tracking.safe_calls import SafeCalls
from forge.io import atomic_write_text
from forge.tracking import NullTracker

ID_FILE = "wandb_id"


class WandbTracker(NullTracker):
    def __init__(self, run_dir: Path, project: str, mode: str = "offline", tags: dict[str, str] | None = None):
        self.run_dir, self.project, self.mode, self.tags = Path(run_dir), project, mode, dict(tags or {})
        self.run = None  # wandb's Run, from the first record on
        self.safe = SafeCalls("W&B")

    def log_params(self, params: dict) -> None:
        self.safe(self._config, params)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.safe(self._config, tags)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.safe(self._log, metrics, step)

    def info(self) -> dict:
        if self.run is None:
            return {}
        return {"wandb_run_id": self.run.id, "wandb_dir": str(Path(self.run.dir).parent)}

    def finish(self, status: str) -> None:
        self.safe(self._finish, status)

    def _start(self) -> None:
        if self.run is not None:
            return
        import wandb

        settings = wandb.Settings(console="off", silent=True)
        self.run = wandb.init(project=self.project, name=self.run_dir.name, id=run_id(self.run_dir),
                              dir=str(self.run_dir), mode=self.mode, resume="allow", config=self.tags,
                              settings=settings)  # fmt: skip
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _config(self, values: dict) -> None:
        self._start()
        self.run.config.update(values, allow_val_change=True)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self._start()
        self.run.log({"step": step, **{k: v for k, v in metrics.items() if v is not None}})

    def _finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def run_id(run_dir: Path) -> str:
    """The W&B run id of a run directory: made once, kept in <run_dir>/wandb_id (a resume reuses it)."""
    path = Path(run_dir) / ID_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8").strip()
    new = secrets.token_hex(6)  # W&B ids: lowercase letters and digits
    atomic_write_text(path, new + "\n")
    return new
