import os

import pytest

from tests.stack_helpers import server_alone


@pytest.fixture
def prefect_server(tmp_path):
    """`forgeweave server --runs-dir <tmp>/runs` on 127.0.0.1 (its home and database under <tmp>/runs/.stack; it asks
    for the runs dir's credentials): yields (api_url, env for processes that use it, without the credentials: a
    `forgeweave serve --runs-dir` of that runs dir takes them itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # the clients' (the server's is in the runs dir)
    with server_alone("server", tmp_path / "runs", tmp_path / "server.log", env) as url:
        yield f"{url}/api", env
