import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect: a private home per test session (its embedded server keeps a sqlite db there), no analytics, quiet logs
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="forgeweave-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.pop("PREFECT_API_URL", None)
# MLflow: every run tracks into the embedded store of its own (temporary) runs dir, never a developer's server
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Ray: clusters the tests start (several nodes on this machine) bind and advertise 127.0.0.1 only; Ray reads this
# when it is imported, so it is set before any test module imports ray
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    d = tmp_path / "runs"
    monkeypatch.setenv("FORGEWEAVE_RUNS_DIR", str(d))
    return d
