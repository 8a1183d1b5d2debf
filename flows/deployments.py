"""Deployments users trigger from the Prefect UI: the pipeline, evaluate-a-checkpoint, prepare-a-dataset.

`forgeweave serve` registers them against the Prefect server in PREFECT_API_URL and serves them from this
process: a "Run" click in the UI starts a flow run here (as a subprocess), with the parameters filled in the form.

Whoever can reach the Prefect API can fill that form, so a served flow run reads and writes files only inside the
served runs directory (`confined`): `serve` records it in $FORGEWEAVE_SERVED_RUNS_DIR, which its flow-run
subprocesses inherit, and a path parameter outside it (`runs_dir`, `config_path`, `checkpoint`, `out_dir`) fails
the flow run with one line. The same flows called in-process (`forgeweave run`) take any path.
"""

from __future__ import annotations

import os
from pathlib import Path

from forge.errors import UserError

SERVED_RUNS_DIR = "FORGEWEAVE_SERVED_RUNS_DIR"

DEPLOYMENTS = {
    "forgeweave-grpo/pipeline": "train with GRPO (parameters: preset, overrides, name)",
    "forgeweave-evaluate/evaluate-checkpoint": "evaluate a checkpoint directory",
    "forgeweave-prepare-dataset/prepare-dataset": "validate / generate a dataset into a directory",
}


def build_deployments(runs_dir: str) -> list:
    from flows.pipeline import evaluate_checkpoint, grpo_pipeline, prepare_dataset

    runs = str(Path(runs_dir).resolve())
    return [
        grpo_pipeline.to_deployment(
            name="pipeline",
            parameters={"preset": "", "runs_dir": runs},  # "": config_path's `preset:` key, else tiny
            tags=["forgeweave"],
            description=DEPLOYMENTS["forgeweave-grpo/pipeline"],
        ),
        evaluate_checkpoint.to_deployment(name="evaluate-checkpoint", tags=["forgeweave"]),
        prepare_dataset.to_deployment(
            name="prepare-dataset", parameters={"out_dir": str(Path(runs) / "datasets")}, tags=["forgeweave"]
        ),
    ]


def confined(path: str, param: str) -> str:
    """`path` unchanged outside a served deployment; in one, the path resolved against the served runs directory,
    or a one-line error when it lies outside it (e.g. `../..`, `/etc`, a symlink out).

    >>> os.environ[SERVED_RUNS_DIR] = "/srv/runs"
    >>> confined("my-run/checkpoints/step-000010", "checkpoint")
    '/srv/runs/my-run/checkpoints/step-000010'
    >>> confined("/tmp/x", "out_dir")
    Traceback (most recent call last):
    forge.errors.UserError: parameter out_dir='/tmp/x' is outside the served runs directory /srv/runs: served deployments read and write only there (forgeweave serve --runs-dir DIR)
    >>> del os.environ[SERVED_RUNS_DIR]
    """  # noqa: E501
    root = os.environ.get(SERVED_RUNS_DIR)
    if not root or not path:
        return path
    base = Path(root).resolve()
    resolved = (base / path).resolve()
    if not resolved.is_relative_to(base):
        raise UserError(
            f"parameter {param}={path!r} is outside the served runs directory {root}: served deployments read and "
            "write only there (forgeweave serve --runs-dir DIR)"
        )
    return str(resolved)


def serve(runs_dir: str, limit: int | None = None) -> None:
    """Register the deployments and serve them until interrupted (their flow runs are confined to runs_dir)."""
    from prefect import serve as prefect_serve

    os.environ[SERVED_RUNS_DIR] = str(Path(runs_dir).resolve())
    prefect_serve(*build_deployments(runs_dir), limit=limit)
