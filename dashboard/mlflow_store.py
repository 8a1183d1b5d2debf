"""Find each run directory's MLflow run (read-only), so the dashboard can show its id and a link.

The tracker writes one MLflow run per pipeline run into the experiment "forgeweave", named after the run
directory and tagged `forgeweave.run_dir` = its absolute path. The store is `$MLFLOW_TRACKING_URI` when set,
else the embedded `sqlite:///<runs-dir>/mlflow.db` when that file exists; with neither there is nothing to read
(the dashboard never creates a store: MLflow would create an empty database on first contact). mlflow is
imported only here, inside the function, and any failure to read the store is returned as a message for the
page to show, never raised: the run directories alone are enough for every page.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

EXPERIMENT = "forgeweave"
RUN_DIR_TAG = "forgeweave.run_dir"


@dataclass(frozen=True)
class MlflowIndex:
    """Which MLflow run belongs to which run directory."""

    uri: str = ""  # tracking URI read ("" when there is no store)
    experiment_id: str = ""  # id of the "forgeweave" experiment ("" when absent)
    by_path: dict[str, str] = field(default_factory=dict)  # absolute run dir -> MLflow run id
    by_name: dict[str, str] = field(default_factory=dict)  # run name -> MLflow run id (newest run of that name)
    error: str = ""  # why the store could not be read

    def run_id(self, name: str, path: str) -> str:
        """The MLflow run id of a run directory: matched by the run-dir tag, else by run name; "" if none."""
        return self.by_path.get(path) or self.by_name.get(name, "")

    def run_url(self, run_id: str) -> str:
        """A link into the MLflow UI when the store is a server; "" for a local file store."""
        if not (run_id and self.uri.startswith(("http://", "https://"))):
            return ""
        return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"


def tracking_uri(runs_dir: Path) -> str:
    """$MLFLOW_TRACKING_URI, else the embedded store's URI if its file exists, else ""."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    db = runs_dir / "mlflow.db"
    return f"sqlite:///{db.resolve()}" if db.is_file() else ""


def read_index(uri: str) -> MlflowIndex:
    """Look up the runs of the "forgeweave" experiment in the store at `uri` (no store: an empty index)."""
    if not uri:
        return MlflowIndex()
    # a server that is down should cost the page a second, not MLflow's default minutes of retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            return MlflowIndex(uri=uri)
        runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    except Exception as e:  # noqa: BLE001 - any store problem is shown on the page, the run dirs still work
        return MlflowIndex(uri=uri, error=f"{type(e).__name__}: {e}".splitlines()[0])
    by_path = {r.data.tags[RUN_DIR_TAG]: r.info.run_id for r in runs if RUN_DIR_TAG in r.data.tags}
    by_name = {r.info.run_name: r.info.run_id for r in runs}  # ascending start time: the newest wins
    return MlflowIndex(uri=uri, experiment_id=experiment.experiment_id, by_path=by_path, by_name=by_name)
