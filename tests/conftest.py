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
# GPUs: hidden unless this is a GPU run (FORGEWEAVE_GPU_TESTS=1, scripts/gpu_check.sh). The suite's tolerances are
# worked out for fp32 on CPU and its two-rank tests use gloo; on a GPU box they would run in bf16 and ask for
# cuda:1. Set before anything initialises CUDA (torch reads it lazily, on first use).
GPU_RUN = os.environ.get("FORGEWEAVE_GPU_TESTS") == "1"
if not GPU_RUN:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; runs only with FORGEWEAVE_GPU_TESTS=1 (tests/gpu/)")


def pytest_collection_modifyitems(config, items):
    """Tests under tests/gpu/ carry the gpu marker; gpu tests are skipped unless a GPU run sees a GPU."""
    import torch

    gpu_dir = os.path.join(os.path.dirname(__file__), "gpu") + os.sep
    have_gpu = GPU_RUN and torch.cuda.is_available()
    why = "needs a CUDA GPU and FORGEWEAVE_GPU_TESTS=1 (scripts/gpu_check.sh)"
    for item in items:
        if str(item.fspath).startswith(gpu_dir):
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") and not have_gpu:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    d = tmp_path / "runs"
    monkeypatch.setenv("FORGEWEAVE_RUNS_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def tok():
    """The character tokenizer of the tiny models (forge.models.build_char_tokenizer), left-padded as the rollout
    backends pad prompts; a module may define its own `tok` where it needs another."""
    from forge.models import build_char_tokenizer

    t = build_char_tokenizer()
    t.padding_side = "left"
    return t
