"""Deployments users trigger from the Prefect UI: the pipeline, evaluate-a-checkpoint, prepare-a-dataset.

`forgeweave serve` registers them against the Prefect server in PREFECT_API_URL and serves them from this
process: a "Run" click in the UI starts a flow run here (as a subprocess), with the parameters filled in the form.
"""

from __future__ import annotations

from pathlib import Path

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
            parameters={"preset": "tiny", "runs_dir": runs},
            tags=["forgeweave"],
            description=DEPLOYMENTS["forgeweave-grpo/pipeline"],
        ),
        evaluate_checkpoint.to_deployment(name="evaluate-checkpoint", tags=["forgeweave"]),
        prepare_dataset.to_deployment(
            name="prepare-dataset", parameters={"out_dir": str(Path(runs) / "datasets")}, tags=["forgeweave"]
        ),
    ]


def serve(runs_dir: str, limit: int | None = None) -> None:
    """Register the deployments and serve them until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(*build_deployments(runs_dir), limit=limit)
