"""The whole local stack with one command: `forgeweave up` / `status` / `down`.

`up` starts, each bound to 127.0.0.1 and in a session of its own, the Prefect server (UI + API), the served
deployments (`forgeweave serve`), an MLflow tracking server, the Streamlit dashboard and a Ray head
(`ray start --head --block`); with `--db postgres` first a private PostgreSQL cluster under the runs directory,
which Prefect and MLflow then use instead of SQLite. It waits until every service answers its health check and
prints the URLs. What it started is recorded in `<runs>/.stack/stack.json` (written atomically): per service
the PID, the process start time (from /proc), the port, the URL and the log file, plus the environment clients
need. `up` again starts only what is not running; `down` stops exactly the recorded processes, by PID, after
checking that each PID still has its recorded start time (a recycled PID is left alone, as `flows.reaper` does),
first with the service's stop signal, then SIGKILL for whatever it left behind.

Every port can be changed (`--prefect-port`, ...). The Prefect UI is told where its API is
(PREFECT_UI_API_URL), so it works on any port; `forgeweave run` with the same runs directory uses the stack's
Prefect and MLflow URLs from the state file (an explicit $PREFECT_API_URL / $MLFLOW_TRACKING_URI wins), and
`forgeweave status --env` prints them as `export` lines for other clients.

Only the owner gets in: Prefect's API asks for an auth string (PREFECT_SERVER_API_AUTH_STRING) and MLflow runs its
basic-auth app; the credentials are made on the first `up`, kept owner-only in `<runs>/.stack/auth/` and reused
(flows/stack_auth.py); the dashboard gets them in its environment, `serve` Prefect's only, `forgeweave run` and the
MLflow tracker take them from there for this stack's servers only, `up` prints where they are. PostgreSQL refuses to run as root:
as root, its cluster directory is owned by, and the server runs as, the `postgres` user of the Debian package (with
its group, none of root's).

No secret is in a command line (any local user reads those): store URIs travel in the environment
(MLFLOW_BACKEND_STORE_URI, PREFECT_API_DATABASE_CONNECTION_URL) and hold no password; PostgreSQL's is in a pgpass file
(PGPASSFILE). Secret files are made O_EXCL, 0600; `<runs>/.stack` and its logs are the owner's (0700, 0600).
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pwd
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flows import stack_auth
from flows.reaper import descendants, kill_recorded
from forge.errors import UserError
from forge.listeners import foreign_listener

STATE_DIR = ".stack"
STATE_FILE = "stack.json"
PG_USER = "forgeweave"  # the superuser of the private cluster
PG_DATABASES = ("prefect", "mlflow")
PG_OS_USER = "postgres"  # who runs the server when forgeweave runs as root (the Debian package's user)
RAY_WORKER_PORTS = (10002, 19999)  # Ray's default range for its worker processes' ports
ORDER = ("postgres", "prefect", "mlflow", "dashboard", "ray", "serve")  # start order; `down` goes backwards


@dataclass(frozen=True)
class Ports:
    """The 127.0.0.1 ports of the stack's services."""

    prefect: int = 4200  # Prefect UI + API
    mlflow: int = 5000  # MLflow UI + tracking API
    dashboard: int = 8501  # Streamlit dashboard
    ray: int = 6379  # Ray head (GCS); runs use it with orchestration.ray_address=127.0.0.1:PORT
    postgres: int = 5433  # private PostgreSQL cluster (--db postgres); not 5432, a system cluster's port


@dataclass(frozen=True)
class StackConfig:
    """What `forgeweave up` starts."""

    runs_dir: Path  # absolute runs directory: state, logs, databases, artifacts, and the runs themselves
    db: str = "sqlite"  # "sqlite" (files in the runs dir) or "postgres" (a private cluster in the runs dir)
    ports: Ports = field(default_factory=Ports)
    timeout_s: float = 90.0  # how long `up` waits for every service to become healthy

    def __post_init__(self) -> None:
        if self.db not in ("sqlite", "postgres"):
            raise UserError(f"--db {self.db}: expected sqlite or postgres")
        if RAY_WORKER_PORTS[0] <= self.ports.ray <= RAY_WORKER_PORTS[1]:
            raise UserError(f"--ray-port {self.ports.ray}: Ray keeps {RAY_WORKER_PORTS} for its workers; pick another")

    @property
    def state_dir(self) -> Path:
        return self.runs_dir / STATE_DIR


@dataclass(frozen=True)
class Service:
    """One process of the stack: how to start it and how to tell it is serving."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    port: int
    url: str  # what a person opens or a client connects to
    health: str  # an http URL that answers 200 when healthy, or "tcp" (the port accepts connections)
    stop_signal: int = signal.SIGTERM
    user: str | None = None  # run as this OS user (PostgreSQL under root)
    health_auth: str = ""  # "prefect": the health URL needs the Prefect API's credentials


# ---------------------------------------------------------------- processes (Linux /proc)


def _proc_start(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process; None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when gone or a zombie)."""
    s = _proc_start(pid)
    return None if s is None or s[0] in ("Z", "X") else s[1]


def alive(rec: dict) -> bool:
    """Is the recorded process still the one we started (same PID, same start time)? (A process that exited before
    its start time was read is recorded with none: never alive.)"""
    return rec["start"] is not None and start_time(rec["pid"]) == rec["start"]


def group_members(pgid: int, not_before: int) -> dict[int, int]:
    """pid -> start time of live processes in process group `pgid` started no earlier than its leader."""
    return {
        pid: int(f[19])
        for pid, f in proc_stats()
        if int(f[2]) == pgid and f[0] not in ("Z", "X") and int(f[19]) >= not_before
    }


def proc_stats():
    """(pid, fields of /proc/PID/stat after the command name) of every live process: state is [0], ppid [1],
    process group [2], session [3], start time [19]."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue


def stop_process(rec: dict, sig: int, timeout: float = 20.0) -> bool:
    """Stop a recorded service and everything it started; True if something was running."""
    if not alive(rec):
        if (s := _proc_start(rec["pid"])) is not None and s[1] != rec["start"]:
            return False  # the PID is another process's now: so is any process group of that number
        # the leader is gone: SIGKILL what is left of its process group (children it left behind)
        return bool(kill_recorded(group_members(rec["pid"], rec["start"])))
    recorded = {rec["pid"]: rec["start"], **descendants(rec["pid"]), **group_members(rec["pid"], rec["start"])}
    with contextlib.suppress(ProcessLookupError):
        os.kill(rec["pid"], sig)
    deadline = time.time() + timeout
    while time.time() < deadline and any(start_time(p) == t for p, t in recorded.items()):
        recorded.update(descendants(rec["pid"]) if alive(rec) else {})
        time.sleep(0.2)
    kill_recorded(recorded)
    return True


def port_free(port: int) -> bool:
    """Can a server listen on 127.0.0.1:port (as servers do, SO_REUSEADDR: a closed socket's TIME_WAIT is no owner)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def healthy(svc: dict, creds: stack_auth.Credentials | None = None) -> bool:
    """Does the service answer: an HTTP 200 from its health URL (with the stack's credentials where the record asks
    for them), or a TCP connection to its port."""
    if svc["health"] == "tcp":
        with socket.socket() as s:
            s.settimeout(2)
            return s.connect_ex(("127.0.0.1", svc["port"])) == 0
    headers = stack_auth.prefect_header(creds) if creds and svc.get("health_auth") == "prefect" else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(svc["health"], headers=headers), timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------- state file


def state_path(runs_dir: Path) -> Path:
    return Path(runs_dir).resolve() / STATE_DIR / STATE_FILE


def read_state(runs_dir: Path) -> dict | None:
    p = state_path(runs_dir)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{p}: unreadable stack state ({e}); stop its processes by PID, then delete it") from None


def write_state(runs_dir: Path, state: dict) -> None:
    """Atomically (temp + rename), readable by the owner only (it names the credentials and the Ray token)."""
    p = state_path(runs_dir)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(p, json.dumps(state, indent=2))


def private_state_dir(cfg: StackConfig) -> Path:
    """The stack's state directory, 0700: its secrets, logs and databases are for the owner. As root with
    PostgreSQL, 0710 with the group of the `postgres` user, who must pass through it to its cluster (and only that)."""
    path = stack_auth.private_dir(cfg.state_dir)
    if cfg.db == "postgres" and os.geteuid() == 0:
        os.chown(path, -1, pwd.getpwnam(PG_OS_USER).pw_gid)
        os.chmod(path, 0o710)
    return path


# ---------------------------------------------------------------- what each service is


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def client_env(cfg: StackConfig) -> dict[str, str]:
    """What a client of this stack exports."""
    return {
        "PREFECT_API_URL": f"http://127.0.0.1:{cfg.ports.prefect}/api",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{cfg.ports.mlflow}",
        "FORGEWEAVE_RUNS_DIR": str(cfg.runs_dir),
    }


def store_uris(cfg: StackConfig) -> tuple[str, str]:
    """(Prefect database URL, MLflow backend store URI): with PostgreSQL, no password in them (the drivers read it
    from the PGPASSFILE that `store_env` names)."""
    if cfg.db == "postgres":
        base = f"{PG_USER}@127.0.0.1:{cfg.ports.postgres}"
        return f"postgresql+asyncpg://{base}/prefect", f"postgresql+psycopg2://{base}/mlflow"
    from flows.tracking.mlflow_tracker import default_uri

    return f"sqlite+aiosqlite:///{cfg.state_dir / 'prefect.db'}", default_uri(cfg.runs_dir)


def store_env(cfg: StackConfig) -> dict[str, str]:
    """What a client of the private PostgreSQL cluster needs besides its URL: the 0600 password file that libpq
    (psycopg2, MLflow's driver) and asyncpg (Prefect's) read when the URL has no password."""
    return {"PGPASSFILE": str(pg_passfile(cfg))} if cfg.db == "postgres" else {}


# credentials a user's environment may hold for other servers: no service inherits them, each gets the stack's
AUTH_VARS = ("PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_KEY", "MLFLOW_TRACKING_USERNAME",
             "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_USERNAME",
             "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY")  # fmt: skip


def services(cfg: StackConfig, creds: stack_auth.Credentials, mlflow_auth: dict[str, str]) -> dict[str, Service]:
    """Every service of the stack, by name, in start order. Prefect's API and MLflow ask for `creds`; `serve` and
    the dashboard (their clients) get Prefect's, the dashboard MLflow's read-only user (`stack_auth.ROLES`), never
    the admin's; `mlflow_auth` is the MLflow server's basic-auth setup. No secret is in
    any argv (any local user reads those with `ps`): they travel in the environment or in 0600 files it names."""
    p = cfg.ports
    own, base = _own_env(), _base_env(cfg)
    out = {}
    if cfg.db == "postgres":
        out["postgres"] = Service(
            "postgres",
            (str(pg_bin("postgres")), "-D", str(pg_dir(cfg) / "data"), "-p", str(p.postgres), "-k", str(pg_dir(cfg)),
             "-c", "listen_addresses=127.0.0.1"),
            own, p.postgres, f"postgresql://{PG_USER}@127.0.0.1:{p.postgres}", "tcp",
            stop_signal=signal.SIGINT,  # "fast shutdown": roll back open transactions, exit
            user=PG_OS_USER if os.geteuid() == 0 else None,
        )  # fmt: skip
    out["prefect"] = prefect_service(cfg, creds)
    out["mlflow"] = mlflow_service(cfg, mlflow_auth)
    cli = (sys.executable, "-m", "flows.cli")
    repo = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(x for x in (repo, os.environ.get("PYTHONPATH", "")) if x)
    # `forgeweave dashboard` adds the login it asks for (the same credentials file: flows.stack.dashboard_env)
    out["dashboard"] = Service(
        "dashboard", (*cli, "dashboard", "--runs-dir", str(cfg.runs_dir), "--port", str(p.dashboard)),
        {**base, **creds.prefect_env(), **creds.role_env("viewer"), "PYTHONPATH": path}, p.dashboard,
        f"http://127.0.0.1:{p.dashboard}",
        f"http://127.0.0.1:{p.dashboard}/_stcore/health",
    )  # fmt: skip
    # Ray takes the machine's address for the head unless told it is no cluster: then it is 127.0.0.1 throughout
    ray_env = {**base, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **ray_client_env(cfg)}
    out["ray"] = Service("ray", ray_argv(cfg), ray_env, p.ray, f"127.0.0.1:{p.ray}", "tcp")
    # a flow run triggered in the UI is a subprocess of `serve`: it tracks into the stack's MLflow server, with the
    # credentials its tracker takes from the runs dir for that server only (a run's tracking.uri may name another)
    out["serve"] = Service(
        "serve", (*cli, "serve", "--runs-dir", str(cfg.runs_dir)),
        {**base, **_prefect_home(cfg), **creds.prefect_env(), "PYTHONPATH": path}, p.prefect,
        f"http://127.0.0.1:{p.prefect}/deployments",
        f"http://127.0.0.1:{p.prefect}/api/deployments/name/forgeweave-grpo/pipeline", health_auth="prefect",
    )  # fmt: skip
    return out


def _own_env() -> dict[str, str]:
    """This process's environment without credentials or addresses meant for other servers."""
    return {k: v for k, v in os.environ.items() if k not in AUTH_VARS and k not in ("RAY_ADDRESS", "PGPASSFILE")}


def _base_env(cfg: StackConfig) -> dict[str, str]:
    return _own_env() | client_env(cfg)


def _prefect_home(cfg: StackConfig) -> dict[str, str]:
    return {
        "PREFECT_HOME": str(cfg.state_dir / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }


def prefect_service(cfg: StackConfig, creds: stack_auth.Credentials) -> Service:
    """The Prefect server (UI + API) of the runs dir, asking every API call but health for `creds`."""
    p = cfg.ports
    prefect_db, _ = store_uris(cfg)
    env = {**_base_env(cfg), **_prefect_home(cfg), "PREFECT_API_DATABASE_CONNECTION_URL": prefect_db, **store_env(cfg)}
    env["PREFECT_SERVER_API_AUTH_STRING"] = creds.prefect_auth_string  # every API call but health: 401 without
    # the UI asks its API at this URL: without it, a server on another port serves a UI that calls 127.0.0.1:4200
    env |= {
        "PREFECT_UI_API_URL": client_env(cfg)["PREFECT_API_URL"],
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(p.prefect),
    }
    return Service(
        "prefect", (_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(p.prefect)), env,
        p.prefect, f"http://127.0.0.1:{p.prefect}", f"http://127.0.0.1:{p.prefect}/api/health",
    )  # fmt: skip


def mlflow_service(cfg: StackConfig, mlflow_auth: dict[str, str]) -> Service:
    """The MLflow server of the runs dir, running MLflow's basic-auth app set up by `mlflow_auth`."""
    p = cfg.ports
    _, mlflow_db = store_uris(cfg)
    # job execution off: 2 processes (~0.5 GB) instead of ~10 (1.9 GB); one worker is plenty for one user
    env = {**_base_env(cfg), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    # `mlflow server` reads --backend-store-uri from this variable (click's envvar): a store URI stays out of argv
    env |= {"MLFLOW_BACKEND_STORE_URI": mlflow_db, **store_env(cfg)}
    return Service(
        "mlflow",
        (_bin("mlflow"), "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(p.mlflow),
         "--workers", "1", "--artifacts-destination", str(cfg.runs_dir / "mlartifacts")),
        env | mlflow_auth, p.mlflow, f"http://127.0.0.1:{p.mlflow}", f"http://127.0.0.1:{p.mlflow}/health",
    )  # fmt: skip


def ray_client_env(cfg: StackConfig) -> dict[str, str]:
    """Ray authenticates its clients with a token: the head's, made once and kept in the state dir (owner-only);
    a driver connecting to the head needs these two variables."""
    token = stack_auth.secret_file(cfg.state_dir / "ray_auth_token", secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def write_private(path: Path, text: str) -> Path:
    """Replace `path` atomically with `text`, owner-only from its first byte (a new temp file, O_EXCL, 0600)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def ray_argv(cfg: StackConfig) -> tuple[str, ...]:
    """`ray start --head --block` on 127.0.0.1, offering the pools Weaver autodetects on this machine (as Ray
    custom resources, like a run's private instance does); --block keeps it in the foreground so it has a PID
    to stop, and on SIGTERM it stops the Ray processes it started."""
    from weaver.apply import pool_resource
    from weaver.discover import discover
    from weaver.pools import autodetect_pools

    res = discover()
    pools = {pool_resource(pl.name): 1000.0 for pl in autodetect_pools(res)}
    return (
        _bin("ray"), "start", "--head", "--block", "--port", str(cfg.ports.ray), "--node-ip-address", "127.0.0.1",
        "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(ray_temp_root(cfg) / "ray"),
        "--num-cpus", str(res.cpu_cores), "--resources", json.dumps(pools),
    )  # fmt: skip


def ray_temp_root(cfg: StackConfig) -> Path:
    """Where the head keeps its temp dir: Ray makes its session, socket and log folders 0777, so they lie in a
    directory only the owner enters (not the shared /tmp/ray). One per user and runs dir, under the system's temp dir:
    Ray's socket paths there must fit in 107 bytes, which a runs dir's path may not leave room for."""
    digest = hashlib.sha256(str(cfg.runs_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"fw-ray-{os.getuid()}-{digest}"


def own_private_dir(path: Path) -> Path:
    """Make `path` (0700), or take the one there if it is this user's own directory; anything else there (another
    user's directory, a symlink: someone took the name first) is refused."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise UserError(f"{path} is not a directory of yours (another user made it?): remove it, then `up` again")
    os.chmod(path, 0o700)
    return path


# ---------------------------------------------------------------- PostgreSQL


def pg_dir(cfg: StackConfig) -> Path:
    return cfg.state_dir / "postgres"


def pg_bin(name: str) -> Path:
    """A PostgreSQL server program: $FORGEWEAVE_PG_BIN, else the newest /usr/lib/postgresql/*/bin (Debian)."""
    dirs = [Path(os.environ["FORGEWEAVE_PG_BIN"])] if os.environ.get("FORGEWEAVE_PG_BIN") else []
    dirs += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda d: int(d.parent.name), reverse=True)
    for d in dirs:
        if (d / name).is_file():
            return d / name
    raise UserError(
        f"--db postgres: PostgreSQL's {name} not found: `apt-get install postgresql` (make test does), "
        "or set FORGEWEAVE_PG_BIN to its bin directory"
    )


def pg_password(cfg: StackConfig) -> str:
    """The cluster's password, made once and kept beside it (owner-only), and the PGPASSFILE its clients read."""
    password_file = stack_auth.secret_file(cfg.state_dir / "postgres.password", secrets.token_urlsafe(18))
    password = password_file.read_text().strip()
    # host:port:database:user:password; token_urlsafe makes no ':' or backslash, which pgpass would need escaped
    write_private(pg_passfile(cfg), f"127.0.0.1:*:*:{PG_USER}:{password}\n")
    return password


def pg_passfile(cfg: StackConfig) -> Path:
    return cfg.state_dir / "postgres.pgpass"


def pg_init(cfg: StackConfig, password: str) -> None:
    """initdb the private cluster once (password auth over TCP, peer on its socket)."""
    root, user = pg_dir(cfg), (PG_OS_USER if os.geteuid() == 0 else None)
    if (root / "data" / "PG_VERSION").is_file():
        return
    stack_auth.private_dir(root)  # 0700 before the password file is in it
    pwfile = root / "initdb.pw"
    pwfile.unlink(missing_ok=True)  # one an interrupted initdb left
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    if user:
        entry = pwd.getpwnam(user)
        for path in (root, pwfile):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        _check_reachable(root, user)
    argv = [str(pg_bin("initdb")), "-D", str(root / "data"), "-U", PG_USER, "--pwfile", str(pwfile)]
    argv += ["--auth-host=scram-sha-256", "--auth-local=peer", "-E", "UTF8", "--locale=C"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=root, **as_user(user))
    finally:
        pwfile.unlink()
    if proc.returncode != 0:
        raise UserError(f"initdb of {root / 'data'} failed: {proc.stderr.strip().splitlines()[-1:]}")


def as_user(user: str | None) -> dict:
    """Popen's arguments that run a program as `user` with that user's group and none of ours (`user=` alone keeps
    root's group and supplementary groups)."""
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _check_reachable(root: Path, user: str) -> None:
    if subprocess.run(["test", "-w", str(root)], **as_user(user)).returncode != 0:
        raise UserError(
            f"--db postgres: user '{user}' (PostgreSQL does not run as root) cannot reach {root}: "
            "pick a runs dir whose parent directories others may enter (chmod o+x)"
        )


def pg_create_databases(cfg: StackConfig, password: str) -> None:
    """CREATE DATABASE prefect / mlflow when missing."""
    import psycopg2

    conn = psycopg2.connect(host="127.0.0.1", port=cfg.ports.postgres, user=PG_USER, password=password,
                            dbname="postgres", connect_timeout=5)  # fmt: skip
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for db in PG_DATABASES:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{db}"')
    finally:
        conn.close()


# ---------------------------------------------------------------- up / status / down


def _launch(cfg: StackConfig, svc: Service) -> dict:
    """Start a service in its own session (so its PID is its process group), output to its log."""
    log = stack_auth.private_dir(cfg.state_dir / "logs") / f"{svc.name}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a log of an earlier `up` may have been made with wider rights
    with os.fdopen(fd, "w") as f:
        if svc.user:
            entry = pwd.getpwnam(svc.user)
            os.chown(log, entry.pw_uid, entry.pw_gid)
        proc = subprocess.Popen(list(svc.argv), env=svc.env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cfg.runs_dir, **as_user(svc.user))  # fmt: skip
    started = start_time(proc.pid)
    return {"pid": proc.pid, "start": started, "port": svc.port, "url": svc.url, "health": svc.health,
            "health_auth": svc.health_auth, "log": str(log), "stop_signal": int(svc.stop_signal),
            "user": svc.user}  # fmt: skip


def squatter(name: str, rec: dict) -> None:
    """An HTTP service's health answer must come from the process group `up` started (its own session), not from a
    local process that took the port first; one line naming who holds it. Not checked: `serve`, which listens on
    nothing (its health is the Prefect API's answer about it), services run as another user (PostgreSQL) and plain
    TCP ones (Ray's head, whose daemons start sessions of their own)."""
    if rec["health"] == "tcp" or rec.get("user") or name == "serve":
        return
    if other := foreign_listener(rec["port"], rec["pid"]):
        raise UserError(f"{name}: port {rec['port']} is answered by another process ({other}), not the {name} `up` "
                        f"started (pid {rec['pid']}): stop that process or start the stack on other ports")  # fmt: skip


def _wait_healthy(cfg: StackConfig, state: dict, names: list[str], deadline: float) -> None:
    creds = stack_auth.read_credentials(cfg.state_dir)
    pending = list(names)
    while pending:
        for name in list(pending):
            rec = state["services"][name]
            if not alive(rec):
                tail = "".join(Path(rec["log"]).read_text(errors="replace").splitlines(True)[-5:]).strip()
                raise UserError(f"{name} exited while starting (log {rec['log']}): {tail[-600:]}")
            if healthy(rec, creds):
                squatter(name, rec)
                pending.remove(name)
        if pending and time.time() > deadline:
            raise UserError(
                f"not healthy after {cfg.timeout_s:.0f} s: {', '.join(pending)} (logs in {cfg.state_dir / 'logs'})"
            )
        time.sleep(0.3)


def _check_settings(cfg: StackConfig, state: dict) -> None:
    """An `up` with other settings than the running stack's is refused rather than half-applied."""
    running = {n for n, rec in state["services"].items() if alive(rec)}
    want = {"db": cfg.db, "ports": vars(cfg.ports)}
    have = {"db": state.get("db"), "ports": state.get("ports")}
    if running and want != have:
        raise UserError(
            f"a stack with other settings is running from {state_path(cfg.runs_dir)} ({', '.join(sorted(running))}): "
            "`forgeweave down` first"
        )


def up(cfg: StackConfig) -> dict:
    """Start what is not running yet, wait until all is healthy; returns the state. Idempotent."""
    private_state_dir(cfg)
    state = read_state(cfg.runs_dir) or {}
    state.setdefault("services", {})
    _check_settings(cfg, state)
    creds, mlflow_auth = _credentials(cfg, state)
    password = pg_password(cfg) if cfg.db == "postgres" else ""
    state.update(db=cfg.db, ports=vars(cfg.ports), runs_dir=str(cfg.runs_dir), env=client_env(cfg))
    state["ray_env"] = ray_client_env(cfg)
    state["credentials"] = str(stack_auth.credentials_path(cfg.state_dir))
    wanted = services(cfg, creds, mlflow_auth)
    state["services"] = {n: r for n, r in state["services"].items() if n in wanted and alive(r)}
    todo = [n for n in wanted if n not in state["services"]]
    _check_ports(cfg, wanted, todo)
    deadline = time.time() + cfg.timeout_s
    started: list[str] = []
    try:
        if "postgres" in todo:
            pg_init(cfg, password)
            _start(cfg, state, wanted["postgres"], started)
        if "postgres" in wanted:
            _wait_healthy(cfg, state, ["postgres"], deadline)
            _wait_pg_ready(cfg, password, deadline)
        if "ray" in todo:
            own_private_dir(ray_temp_root(cfg))
        for name in ("prefect", "mlflow", "dashboard", "ray"):
            if name in todo:
                _start(cfg, state, wanted[name], started)
        _wait_healthy(cfg, state, ["prefect"], deadline)
        if "serve" in todo:
            _start(cfg, state, wanted["serve"], started)
        _wait_healthy(cfg, state, list(wanted), deadline)
    except BaseException:
        for name in reversed(started):  # a failed `up` leaves nothing of its own behind
            stop_process(state["services"][name], state["services"][name]["stop_signal"])
            state["services"].pop(name)
        if state["services"]:
            write_state(cfg.runs_dir, state)
        else:
            state_path(cfg.runs_dir).unlink(missing_ok=True)
        raise
    state["started"] = started
    return state


def _credentials(cfg: StackConfig, state: dict) -> tuple[stack_auth.Credentials, dict[str, str]]:
    """The stack's credentials (made on the first `up`, then reused) and the MLflow server's auth setup."""
    creds, fresh = credentials(cfg.runs_dir, state)
    return creds, stack_auth.mlflow_server_env(cfg.state_dir, creds, fresh)


def credentials(runs_dir: Path, state: dict | None = None) -> tuple[stack_auth.Credentials, bool]:
    """(the runs dir's stack credentials, whether they were made just now): made by whichever of `up` or a server
    started alone comes first, then reused by all. Refused while the stack runs without its credentials file (its
    servers hold the old ones: new ones would lock its clients out)."""
    state_dir = Path(runs_dir).resolve() / STATE_DIR
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new one is the owner's (an existing one is up's)
    state = state if state is not None else (read_state(runs_dir) or {"services": {}})
    running = sorted(n for n, rec in state["services"].items() if alive(rec))
    if running and stack_auth.read_credentials(state_dir) is None:
        raise UserError(
            f"{stack_auth.credentials_path(state_dir)} is missing while the stack runs ({', '.join(running)}): "
            "`forgeweave down`, then `forgeweave up` makes new credentials"
        )
    return stack_auth.ensure_credentials(state_dir)


def credentials_note(path: Path) -> str:
    """The line a started server prints about its credentials (where they are, never what they are)."""
    return (f"credentials: {path} (owner-only; the Prefect UI asks for its PREFECT_API_AUTH_STRING, MLflow and the "
            "dashboard for MLFLOW_TRACKING_USERNAME/PASSWORD)")  # fmt: skip


# ---------------------------------------------------------------- servers started alone

ALONE_DIR = "alone"  # <runs>/.stack/alone/<service>-<port>.json: a server `forgeweave server` / `mlflow` started


def start_alone(name: str, runs_dir: str, port: int) -> int:
    """`forgeweave server` (name "prefect") or `forgeweave mlflow`: replace this process with the server `up` starts
    for the runs dir (the same argv, environment, store and credentials), on `port`. It is recorded (PID, start
    time, client URL) so that this runs dir's clients (`serve`, `run`, the tracker, the dashboard) give it the
    credentials while it runs, and nothing else does."""
    cfg = StackConfig(Path(runs_dir).resolve(), ports=Ports(**{name: port}))
    cfg.runs_dir.mkdir(parents=True, exist_ok=True)
    creds, fresh = credentials(cfg.runs_dir)
    if name == "prefect":
        svc = prefect_service(cfg, creds)
    else:
        svc = mlflow_service(cfg, stack_auth.mlflow_server_env(cfg.state_dir, creds, fresh))
    key = "PREFECT_API_URL" if name == "prefect" else "MLFLOW_TRACKING_URI"
    _record_alone(cfg, svc, {key: client_env(cfg)[key]})
    print(f"{name} on {svc.url} (runs: {cfg.runs_dir}) — export {key}={client_env(cfg)[key]}")
    print(credentials_note(stack_auth.credentials_path(cfg.state_dir)))
    print(f"  `forgeweave serve|run --runs-dir {cfg.runs_dir}` use them by themselves; other clients: "
          f"set -a; . {stack_auth.credentials_path(cfg.state_dir)}; set +a", flush=True)  # fmt: skip
    os.execve(svc.argv[0], list(svc.argv), svc.env)


def _record_alone(cfg: StackConfig, svc: Service, env: dict[str, str]) -> None:
    """Note this process (about to become `svc`: execve keeps the PID) as a server of the runs dir; records of
    servers that are gone are removed."""
    folder = stack_auth.private_dir(cfg.state_dir / ALONE_DIR)
    for path, rec in _alone_records(cfg.runs_dir):
        if not alive(rec):
            path.unlink(missing_ok=True)
    rec = {"pid": os.getpid(), "start": start_time(os.getpid()), "env": env}
    write_private(folder / f"{svc.name}-{svc.port}.json", json.dumps(rec))


def _alone_records(runs_dir: Path) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted((Path(runs_dir).resolve() / STATE_DIR / ALONE_DIR).glob("*.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue  # being replaced, or not ours to read: no credentials for it
    return out


def dashboard_env(runs_dir: Path) -> dict[str, str]:
    """What `forgeweave dashboard` adds to its environment: the login it asks for (flows.stack_auth.dashboard_env)
    and, as a client, the credentials of this runs dir's Prefect / MLflow server that $PREFECT_API_URL /
    $MLFLOW_TRACKING_URI name (unless set: the user's win)."""
    creds, _ = credentials(runs_dir)
    env = stack_auth.dashboard_env(Path(runs_dir).resolve() / STATE_DIR, creds)
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        found = credentials_for(Path(runs_dir), os.environ.get(key, ""), role="viewer")
        env |= {k: v for k, v in found.items() if not os.environ.get(k)}
    return env


def _start(cfg: StackConfig, state: dict, svc: Service, started: list[str]) -> None:
    state["services"][svc.name] = _launch(cfg, svc)
    started.append(svc.name)
    write_state(cfg.runs_dir, state)  # recorded at once: `down` can stop it even if this `up` is killed


def _check_ports(cfg: StackConfig, wanted: dict[str, Service], todo: list[str]) -> None:
    flags = {"prefect": "--prefect-port", "mlflow": "--mlflow-port", "dashboard": "--dashboard-port",
             "ray": "--ray-port", "postgres": "--postgres-port"}  # fmt: skip
    ports = {n: wanted[n].port for n in todo if n != "serve"}
    for name, port in ports.items():
        if not port_free(port):
            raise UserError(f"port {port} (127.0.0.1) for {name} is in use: choose another with {flags[name]} PORT")


def _wait_pg_ready(cfg: StackConfig, password: str, deadline: float) -> None:
    """The port opens before the server accepts logins: retry the connection until the databases exist."""
    import psycopg2

    while True:
        try:
            pg_create_databases(cfg, password)
            return
        except psycopg2.OperationalError as e:
            if time.time() > deadline:
                raise UserError(f"PostgreSQL on port {cfg.ports.postgres} does not accept logins: {e}") from None
            time.sleep(0.3)


def status(runs_dir: Path) -> dict[str, dict]:
    """name -> {running, healthy, pid, url} for each recorded service ({} when no stack was started here)."""
    state = read_state(runs_dir) or {"services": {}}
    creds = stack_auth.read_credentials(state_path(runs_dir).parent)
    out = {}
    for name, rec in state["services"].items():
        running = alive(rec)
        out[name] = {"running": running, "healthy": running and healthy(rec, creds), "pid": rec["pid"],
                     "url": rec["url"]}  # fmt: skip
    return out


def down(runs_dir: Path) -> list[str]:
    """Stop every recorded service (reverse start order), by PID; returns the names of those that were running."""
    state = read_state(runs_dir)
    if state is None:
        return []
    stopped = []
    names = sorted(state["services"], key=lambda n: -ORDER.index(n) if n in ORDER else 0)
    for name in names:
        rec = state["services"][name]
        if stop_process(rec, rec.get("stop_signal", signal.SIGTERM)):
            stopped.append(name)
        state["services"].pop(name)
        write_state(runs_dir, state)
    state_path(runs_dir).unlink()
    return stopped


def use_stack(runs_dir: str) -> dict[str, str]:
    """For `forgeweave run`: when a stack is up for this runs dir, take its Prefect/MLflow URLs (unless the
    environment already names others); when the environment then points at a Prefect API of this runs dir (the
    stack's, or a `forgeweave server` started alone), that API's credentials (unless set). Returns the URLs that were
    set. MLflow's are left to the tracker, which sets them only for the URI it really tracks to (a config's
    tracking.uri may name another server: it must not get them)."""
    state = read_state(Path(runs_dir)) if Path(runs_dir).is_dir() else None
    taken = {}
    services = (state or {}).get("services", {})
    if {"prefect", "mlflow"} <= set(services) and all(alive(services[n]) for n in ("prefect", "mlflow")):
        taken = {k: v for k, v in state["env"].items() if k != "FORGEWEAVE_RUNS_DIR" and not os.environ.get(k)}
        os.environ.update(taken)
    for key, value in credentials_for(Path(runs_dir), os.environ.get("PREFECT_API_URL", "")).items():
        os.environ.setdefault(key, value)
    return taken


def credentials_for(runs_dir: Path, url: str, role: str = "run") -> dict[str, str]:
    """The client variables of this runs dir's stack credentials when `url` is the Prefect API or MLflow server of
    this runs dir that runs now (`up`'s, or one started alone); {} for any other URL (a port another user took after
    the server stopped included), or when there is no credentials file. MLflow's are those of the `role` user
    (`flows.stack_auth.ROLES`: 'run' for runs, 'viewer' for the dashboard), never the admin's."""
    creds = stack_auth.read_credentials(Path(runs_dir).resolve() / STATE_DIR) if url else None
    if creds is None:
        return {}
    for key, server in _live_servers(Path(runs_dir)):
        if url.rstrip("/") == server.rstrip("/"):
            return creds.prefect_env() if key == "PREFECT_API_URL" else creds.role_env(role)
    return {}


def _live_servers(runs_dir: Path) -> list[tuple[str, str]]:
    """(client variable, URL) of each Prefect API and MLflow server of the runs dir that runs now."""
    state = read_state(runs_dir) or {"services": {}}
    out = []
    for name, key in (("prefect", "PREFECT_API_URL"), ("mlflow", "MLFLOW_TRACKING_URI")):
        if name in state["services"] and alive(state["services"][name]):
            out.append((key, state["env"][key]))
    return out + [item for _, rec in _alone_records(runs_dir) if alive(rec) for item in rec["env"].items()]


# ---------------------------------------------------------------- command line


def add_commands(sub, runs_dir_arg) -> None:
    """The `up`, `status` and `down` subcommands of `forgeweave`."""
    u = sub.add_parser("up", help="start the local stack (Prefect server + deployments, MLflow, dashboard, Ray head)")
    runs_dir_arg(u)
    u.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite", help="Prefect/MLflow backend store")
    for name, default in vars(Ports()).items():
        u.add_argument(f"--{name.replace('_', '-')}-port", type=int, default=default, dest=f"port_{name}",
                       metavar="PORT", help=f"{name}'s port on 127.0.0.1 (default {default})")  # fmt: skip
    u.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for every service (default 90)")
    s = sub.add_parser("status", help="is each service of the local stack running and healthy")
    runs_dir_arg(s)
    s.add_argument("--env", action="store_true", help="print the stack's client settings as `export` lines")
    d = sub.add_parser("down", help="stop what `forgeweave up` started (by PID)")
    runs_dir_arg(d)


def cmd_up(args: argparse.Namespace) -> int:
    ports = Ports(**{name: getattr(args, f"port_{name}") for name in vars(Ports())})
    cfg = StackConfig(Path(args.runs_dir).resolve(), db=args.db, ports=ports, timeout_s=args.timeout)
    t0 = time.time()
    state = up(cfg)
    fresh = state["started"]
    print(f"stack up in {time.time() - t0:.1f} s ({', '.join(fresh) + ' started' if fresh else 'already running'});"
          f" state: {state_path(cfg.runs_dir)}")  # fmt: skip
    print(credentials_note(state["credentials"]))
    if "dashboard" in state["services"]:  # the same token `forgeweave dashboard` prints (its log is up's)
        print(f"dashboard: {state['services']['dashboard']['url']}/?token={stack_auth.dashboard_token(cfg.state_dir)}")
    _print_table(status(cfg.runs_dir))
    _print_env(state)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = read_state(Path(args.runs_dir))
    if state is None:
        print(f"no stack started for {Path(args.runs_dir).resolve()} (`forgeweave up`)")
        return 3
    if args.env:  # with the credentials: `eval "$(forgeweave status --env)"` makes a client that gets in
        creds = stack_auth.read_credentials(state_path(args.runs_dir).parent)
        env = {**state["env"], **(creds.env() if creds else {})}
        print("\n".join(f"export {k}={v}" for k, v in env.items()))
        return 0
    report = status(Path(args.runs_dir))
    _print_table(report)
    return 0 if report and all(r["healthy"] for r in report.values()) else 1


def cmd_down(args: argparse.Namespace) -> int:
    stopped = down(Path(args.runs_dir))
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def _print_table(report: dict[str, dict]) -> None:
    for name, r in report.items():
        state = "healthy" if r["healthy"] else ("running, not healthy" if r["running"] else "not running")
        print(f"  {name:<10} {state:<22} pid {r['pid']:<8} {r['url']}")


def _print_env(state: dict) -> None:
    print("clients (`forgeweave run --runs-dir` this dir uses these and the credentials by itself; "
          "`forgeweave status --env` prints them all):")  # fmt: skip
    for k, v in state["env"].items():
        print(f"  export {k}={v}")
    ray_env = " ".join(f"{k}={v}" for k, v in state["ray_env"].items())
    print(f"  Ray: {ray_env} forgeweave run --set orchestration.ray_address={state['services']['ray']['url']}")
