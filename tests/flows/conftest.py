import os

import pytest

from tests.servers import BIN, free_port, start, stop, wait_http


@pytest.fixture
def prefect_server(tmp_path):
    """A Prefect server on 127.0.0.1 with a private home: yields (api_url, env for processes that use it)."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    proc = start([str(BIN / "forgeweave"), "server", "--port", str(port)], env, tmp_path / "server.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", timeout=90)
        yield f"http://127.0.0.1:{port}/api", env
    finally:
        stop(proc)
