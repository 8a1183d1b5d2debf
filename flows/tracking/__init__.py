"""The trackers behind forge's `Tracker` protocol: MLflow (the system of record, fed through an outbox in the run
directory), TensorBoard and W&B. They live here, not in forge, so forge never imports a tracking package.

- `flows.tracking.mlflow_tracker`: `MlflowTracker`, `sync_run` (`forgeweave sync`), `default_uri`, `mlflow_key`;
  mlflow is imported only inside the sending code.
- `flows.tracking.outbox`: the append-only outbox and its state file (pure file handling).
- `flows.tracking.tensorboard_tracker`, `flows.tracking.wandb_tracker`: optional, their packages imported only
  when they send; both go through `flows.tracking.safe_calls.SafeCalls`.

`trackers_for_run` builds what `tracking.*` turns on; `forgeweave run` and the Prefect flow pass its result to the
recipe as `tracker=`, and so can a `forge.train` caller (`forge.train(..., tracker=trackers_for_run)`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from forge.errors import UserError
from forge.tracking import MultiTracker, Tracker


def require_package(package: str, key: str) -> None:
    """A UserError (before any training) when `key` turns on a tracker whose package is not installed."""
    if importlib.util.find_spec(package) is None:
        raise UserError(f"{key}=true needs the {package} package: pip install 'forgeweave[{package}]' (or turn it off)")


def trackers_for_run(cfg, run_dir: Path, tags: dict[str, str] | None = None) -> Tracker | None:
    """The trackers `tracking.*` turns on besides metrics.jsonl: MLflow, TensorBoard, W&B (None when none is)."""
    from flows.tracking.mlflow_tracker import tracker_for_run

    t = cfg.tracking
    found: list[Tracker] = []
    if (mlflow := tracker_for_run(cfg, run_dir, tags)) is not None:
        found.append(mlflow)
    if t.tensorboard:
        from flows.tracking.tensorboard_tracker import TensorBoardTracker

        require_package("tensorboard", "tracking.tensorboard")
        found.append(TensorBoardTracker(Path(run_dir) / "tensorboard"))
    if t.wandb:
        from flows.tracking.wandb_tracker import WandbTracker

        require_package("wandb", "tracking.wandb")
        found.append(WandbTracker(Path(run_dir), t.wandb_project, t.wandb_mode, tags or {}))
    return None if not found else found[0] if len(found) == 1 else MultiTracker(*found)
