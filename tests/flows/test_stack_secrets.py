"""Issue 46: no secret of the local stack is in a process's command line (any local user reads those with `ps`),
and the files that hold them are the owner's only from their first byte — checked on the launch specs
`flows.stack.services` builds, without starting a stack (tests/flows/test_stack.py reads /proc/PID/cmdline of the
real stack's processes)."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from flows import stack, stack_auth
from forge.errors import UserError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def pg_bin(tmp_path, monkeypatch):
    """Stand-ins for PostgreSQL's programs: the specs only name them."""
    bindir = tmp_path / "pgbin"
    bindir.mkdir()
    for name in ("postgres", "initdb"):
        (bindir / name).write_text("")
    monkeypatch.setenv("FORGEWEAVE_PG_BIN", str(bindir))
    return bindir


def _specs(runs: Path, db: str) -> tuple[stack.StackConfig, dict[str, stack.Service], list[str]]:
    """(config, every service's launch spec, every secret the stack holds) as `up` makes them."""
    cfg = stack.StackConfig(runs, db=db)
    stack.private_state_dir(cfg)
    creds, fresh = stack_auth.ensure_credentials(cfg.state_dir)
    mlflow_auth = stack_auth.mlflow_server_env(cfg.state_dir, creds, fresh)
    password = stack.pg_password(cfg) if db == "postgres" else ""
    specs = stack.services(cfg, creds, mlflow_auth)
    ray_token = Path(stack.ray_client_env(cfg)["RAY_AUTH_TOKEN_PATH"]).read_text()
    found = [creds.prefect_auth_string, creds.prefect_auth_string.split(":", 1)[1], creds.mlflow_password,
             creds.role_password("run"), creds.role_password("viewer"), mlflow_auth["MLFLOW_FLASK_SERVER_SECRET_KEY"],
             ray_token, password]  # fmt: skip
    return cfg, specs, [s for s in found if s]


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_no_service_argv_holds_a_secret(tmp_path, pg_bin, db):
    cfg, specs, secrets = _specs(tmp_path / "runs", db)
    expected = {"prefect", "mlflow", "dashboard", "ray", "serve"} | ({"postgres"} if db == "postgres" else set())
    assert set(specs) == expected
    for name, svc in specs.items():
        line = " ".join(svc.argv)
        assert not [s for s in secrets if s in line], f"{name}'s argv holds a secret: {svc.argv}"
        assert not any(a.startswith("--backend-store-uri") for a in svc.argv), name
    argv = specs["ray"].argv  # the head's temp dir, where Ray makes 0777 folders, lies in a 0700 one of the user's
    assert Path(argv[argv.index("--temp-dir") + 1]).parent == stack.ray_temp_root(cfg)
    mlflow_env = specs["mlflow"].env  # `mlflow server` reads its store URI from there (click's envvar)
    assert mlflow_env["MLFLOW_BACKEND_STORE_URI"] == stack.store_uris(cfg)[1]


def test_the_database_password_reaches_its_clients_only_through_a_0600_pgpass_file(tmp_path, pg_bin):
    cfg, specs, _ = _specs(tmp_path / "runs", "postgres")
    password = (cfg.state_dir / "postgres.password").read_text().strip()
    port = cfg.ports.postgres
    mlflow_uri = specs["mlflow"].env["MLFLOW_BACKEND_STORE_URI"]
    prefect_url = specs["prefect"].env["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert mlflow_uri == f"postgresql+psycopg2://forgeweave@127.0.0.1:{port}/mlflow"
    assert prefect_url == f"postgresql+asyncpg://forgeweave@127.0.0.1:{port}/prefect"
    for name, svc in specs.items():  # not in any environment either: only in the file the drivers read
        assert not [k for k, v in svc.env.items() if password in v], name
    passfile = cfg.state_dir / "postgres.pgpass"
    for name in ("prefect", "mlflow"):
        assert specs[name].env["PGPASSFILE"] == str(passfile), name
    assert passfile.read_text() == f"127.0.0.1:*:*:forgeweave:{password}\n"
    for path in (passfile, cfg.state_dir / "postgres.password", cfg.state_dir / "ray_auth_token",
                 stack_auth.credentials_path(cfg.state_dir), cfg.state_dir / "auth" / "mlflow-auth.ini"):  # fmt: skip
        assert _mode(path) == 0o600, path
    assert stack.pg_password(cfg) == password and _mode(passfile) == 0o600  # `up` again: the same, still 0600


def test_state_dir_is_the_owners(tmp_path, pg_bin):
    cfg = stack.StackConfig(tmp_path / "runs")
    assert _mode(stack.private_state_dir(cfg)) == 0o700
    cfg.state_dir.chmod(0o755)  # made by an older version: narrowed
    cfg = stack.StackConfig(tmp_path / "runs", db="postgres")
    stack.private_state_dir(cfg)
    if os.geteuid() == 0:  # the `postgres` user passes through to its cluster, and may do nothing else there
        assert _mode(cfg.state_dir) == 0o710 and cfg.state_dir.stat().st_gid == pwd.getpwnam("postgres").pw_gid
    else:
        assert _mode(cfg.state_dir) == 0o700


def test_initdb_reads_an_owner_only_password_file_in_an_owner_only_dir(tmp_path, pg_bin, monkeypatch):
    """The setup password file is 0600 in a 0700 directory while initdb runs (it was 0644 in a 0755 one), and is
    gone afterwards."""
    cfg = stack.StackConfig(tmp_path / "runs", db="postgres")
    stack.private_state_dir(cfg)
    seen = {}

    def fake_run(argv, **kwargs):
        if argv[0].endswith("initdb"):
            pwfile = Path(argv[argv.index("--pwfile") + 1])
            seen.update(file=_mode(pwfile), dir=_mode(pwfile.parent), text=pwfile.read_text(), argv=argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(stack.subprocess, "run", fake_run)
    stack.pg_init(cfg, "s3cret-pw")
    assert seen["file"] == 0o600 and seen["dir"] == 0o700 and seen["text"] == "s3cret-pw\n"
    assert "s3cret-pw" not in " ".join(seen["argv"])
    assert not (stack.pg_dir(cfg) / "initdb.pw").exists()


def test_service_logs_are_owner_only(tmp_path):
    cfg = stack.StackConfig(tmp_path / "runs")
    stack.private_state_dir(cfg)
    (cfg.state_dir / "logs").mkdir(mode=0o755)
    (cfg.state_dir / "logs" / "echo.log").write_text("old\n")
    (cfg.state_dir / "logs" / "echo.log").chmod(0o644)  # a log of an earlier `up`
    rec = stack._launch(cfg, stack.Service("echo", ("/bin/echo", "hello"), {}, 1, "", "tcp"))  # made before it runs
    assert _mode(cfg.state_dir / "logs") == 0o700 and _mode(Path(rec["log"])) == 0o600


def test_the_ray_heads_private_dir_is_made_0700_or_refused_when_someone_else_took_its_name(tmp_path):
    mine = stack.own_private_dir(tmp_path / "mine")
    assert _mode(mine) == 0o700
    mine.chmod(0o777)
    assert _mode(stack.own_private_dir(mine)) == 0o700  # taken again, narrowed
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(UserError, match="link is not a directory of yours"):
        stack.own_private_dir(tmp_path / "link")
    if os.geteuid() == 0:  # only root can make a directory that another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UserError, match="theirs is not a directory of yours"):
            stack.own_private_dir(theirs)
    assert stack.ray_temp_root(stack.StackConfig(tmp_path / "a")) != stack.ray_temp_root(stack.StackConfig(tmp_path))
    assert len(str(stack.ray_temp_root(stack.StackConfig(tmp_path / ("x" * 200))))) < 50  # room for Ray's sockets
