"""Who may use the local stack: the credentials `forgeweave up` turns Prefect's and MLflow's authentication on with.

The first `up` of a runs dir makes them with `secrets` and writes `<runs>/.stack/auth/credentials.env` (directory
0700, file 0600, created owner-only from the first byte); every later `up` reuses them. The file is what a client
exports (KEY=value lines, also usable as `docker --env-file` or `set -a; . FILE`):

    PREFECT_API_AUTH_STRING=forgeweave:<password>  Prefect clients; the server gets the same string as
                                                   PREFECT_SERVER_API_AUTH_STRING and then refuses (401) any API
                                                   call without it, except GET /api/health and /api/ready
    MLFLOW_TRACKING_USERNAME=forgeweave            MLflow clients (HTTP basic auth); the server runs MLflow's
    MLFLOW_TRACKING_PASSWORD=<password>            basic-auth app, whose admin user is this one

MLflow's basic-auth app (`mlflow server --app-name basic-auth`) reads `auth/mlflow-auth.ini` (named by
MLFLOW_AUTH_CONFIG_PATH): its own user database `auth/mlflow-auth.db` (SQLite), the admin's name and the
permission other users get by default. MLflow 3.17 ships no default admin password: it creates the admin user on
its first start with MLFLOW_AUTH_ADMIN_PASSWORD, which `up` sets to the generated password (the password that
earlier versions shipped, `password1234`, is refused there). When credentials are made anew (the file was deleted)
while the user database already exists, `up` sets the admin's password in it to the new one first, so the file
always says what works. The Flask secret the app needs (MLFLOW_FLASK_SERVER_SECRET_KEY, for the CSRF token of its
sign-up form) is made for each start and never stored.

The same file serves the servers started alone (`forgeweave server`, `mlflow`: `flows.stack.start_alone`) and the
dashboard, which asks for a login: the MLflow user and password above, or the token of the URL it prints (kept in
`auth/dashboard.token`, 0600; it opens the read-only dashboard and nothing else).

Least privilege: the admin's password is the person's; what forgeweave's own processes hold is less. Each start of
the MLflow server makes (or renews) two users who are not admins in its user database, with passwords derived from
the admin's (HMAC-SHA256, so the file holds no more lines and new credentials renew them):

    forgeweave-run     runs and the flow runs `serve` starts log with it: MLflow's basic-auth app lets any user
                       create an experiment and makes its creator its manager, and every other user's experiments
                       are READ to it (`default_permission`); it cannot manage users or touch others' experiments
    forgeweave-viewer  the dashboard reads MLflow with it: READ

The dashboard checks the login against a salted PBKDF2 digest of the admin's password, not the password itself, so
no process forgeweave starts holds the admin's password but the MLflow server (which needs it to make that user).
An experiment made by another user (the person, in MLflow's UI, or runs of versions before these users) is
READ-only to runs: the tracker says so in one line (grant forgeweave-run EDIT on it, or name another experiment).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import warnings
from dataclasses import dataclass
from pathlib import Path

AUTH_DIR = "auth"
CREDENTIALS_FILE = "credentials.env"
MLFLOW_AUTH_INI = "mlflow-auth.ini"
MLFLOW_AUTH_DB = "mlflow-auth.db"
DASHBOARD_TOKEN = "dashboard.token"
# what the dashboard app accepts (dashboard/login.py reads them; the dashboard never imports flows)
DASHBOARD_LOGIN_VAR = "FORGEWEAVE_DASHBOARD_LOGIN"  # "user:password"
DASHBOARD_TOKEN_VAR = "FORGEWEAVE_DASHBOARD_TOKEN"  # the ?token= of the URL `forgeweave dashboard` prints
USER = "forgeweave"  # the user name of both servers (Prefect's basic auth takes any name: the string is the secret)
# MLflow users with less than the admin's rights (module docstring): role -> user name
ROLES = {"run": "forgeweave-run", "viewer": "forgeweave-viewer"}
LOGIN_ITERATIONS = 200_000  # PBKDF2-SHA256 rounds of the dashboard's login digest (~0.1 s a check here)


@dataclass(frozen=True)
class Credentials:
    """One stack's credentials, as the environment variables its clients read."""

    prefect_auth_string: str  # "user:password": PREFECT_API_AUTH_STRING (clients), ..._SERVER_... (the server)
    mlflow_username: str  # MLFLOW_TRACKING_USERNAME: MLflow's admin user
    mlflow_password: str  # MLFLOW_TRACKING_PASSWORD

    def prefect_env(self) -> dict[str, str]:
        return {"PREFECT_API_AUTH_STRING": self.prefect_auth_string}

    def mlflow_env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": self.mlflow_username, "MLFLOW_TRACKING_PASSWORD": self.mlflow_password}

    def env(self) -> dict[str, str]:
        return {**self.prefect_env(), **self.mlflow_env()}

    def role_password(self, role: str) -> str:
        """The password of MLflow user `ROLES[role]`, derived from the admin's (one-way: it gives no admin rights)."""
        digest = hmac.new(self.mlflow_password.encode(), f"forgeweave mlflow {ROLES[role]}".encode(), hashlib.sha256)
        return base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")

    def role_env(self, role: str) -> dict[str, str]:
        """MLflow client variables of the `role` user ('run': runs; 'viewer': the dashboard)."""
        return {"MLFLOW_TRACKING_USERNAME": ROLES[role], "MLFLOW_TRACKING_PASSWORD": self.role_password(role)}


def auth_dir(state_dir: Path) -> Path:
    return Path(state_dir) / AUTH_DIR


def credentials_path(state_dir: Path) -> Path:
    return auth_dir(state_dir) / CREDENTIALS_FILE


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner may enter (made 0700, or narrowed to it)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def ensure_credentials(state_dir: Path) -> tuple[Credentials, bool]:
    """(the stack's credentials, whether they were made just now): read from the file, else made and written."""
    path = credentials_path(state_dir)
    private_dir(path.parent)
    if (creds := read_credentials(state_dir)) is not None:
        os.chmod(path, 0o600)  # a file copied in with wider rights is narrowed
        return creds, False
    creds = Credentials(f"{USER}:{secrets.token_urlsafe(24)}", USER, secrets.token_urlsafe(24))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# the local stack's credentials (made by `forgeweave up`; keep this file owner-only)\n")
        f.writelines(f"{k}={v}\n" for k, v in creds.env().items())
    os.replace(tmp, path)
    return creds, True


def read_credentials(state_dir: Path) -> Credentials | None:
    """The credentials in `<state_dir>/auth/credentials.env`; None when there is no such file (or it lacks a key)."""
    try:
        text = credentials_path(state_dir).read_text()
    except OSError:
        return None
    env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    keys = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    if not all(env.get(k) for k in keys):
        return None
    return Credentials(*(env[k].strip() for k in keys))


def secret_file(path: Path, secret: str) -> Path:
    """`path`, holding `secret` if it did not exist yet (created owner-only: never readable by others, even briefly;
    one found with wider rights is narrowed to 0600)."""
    if not path.is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secret)
    os.chmod(path, 0o600)
    return path


def dashboard_token(state_dir: Path) -> str:
    """The token of the dashboard's URL: made once, then reused (a printed URL keeps working across restarts)."""
    return secret_file(auth_dir(state_dir) / DASHBOARD_TOKEN, secrets.token_urlsafe(24)).read_text().strip()


def dashboard_env(state_dir: Path, creds: Credentials) -> dict[str, str]:
    """What the dashboard checks a visitor against: the stack's MLflow user and a salted digest of its password
    (`login_digest`), and the URL token."""
    login = f"{creds.mlflow_username}:{login_digest(creds.mlflow_password)}"
    return {DASHBOARD_LOGIN_VAR: login, DASHBOARD_TOKEN_VAR: dashboard_token(state_dir)}


def login_digest(password: str, salt: bytes | None = None) -> str:
    """The salted digest of `password`, "pbkdf2_sha256$ROUNDS$SALT$DIGEST" (hex), that dashboard/login.py checks."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, LOGIN_ITERATIONS)
    return f"pbkdf2_sha256${LOGIN_ITERATIONS}${salt.hex()}${digest.hex()}"


def mlflow_server_env(state_dir: Path, creds: Credentials, fresh: bool) -> dict[str, str]:
    """What the MLflow server's process needs for its basic-auth app; writes its config file (0600)."""
    db = auth_dir(state_dir) / MLFLOW_AUTH_DB
    ini = auth_dir(state_dir) / MLFLOW_AUTH_INI
    text = (
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{db}\n"
        f"admin_username = {creds.mlflow_username}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    fd = os.open(ini, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    _sync_users(f"sqlite:///{db}", creds, fresh)
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_USERNAME": creds.mlflow_username,
        "MLFLOW_AUTH_ADMIN_PASSWORD": creds.mlflow_password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),
    }


def _sync_users(db_uri: str, creds: Credentials, fresh: bool) -> None:
    """The user database before the server starts: the `ROLES` users made, or their passwords renewed, never admins;
    new credentials with an old database: the admin's password there becomes the new one (MLflow would keep the old
    one, known to nobody, since it reads MLFLOW_AUTH_ADMIN_PASSWORD only when it creates the admin, on its first
    start)."""
    with warnings.catch_warnings():  # importing mlflow.server warns about its Starlette (stderr of `up`, a CLI's)
        warnings.simplefilter("ignore")
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore()
    store.init_db(db_uri)
    if fresh and store.has_user(creds.mlflow_username):
        store.update_user(creds.mlflow_username, password=creds.mlflow_password, is_admin=True)
    for role, user in ROLES.items():
        if store.has_user(user):
            store.update_user(user, password=creds.role_password(role), is_admin=False)
        else:
            store.create_user(user, creds.role_password(role), is_admin=False)


def basic_auth_header(user: str, password: str) -> dict[str, str]:
    """The HTTP header of basic authentication (Prefect's auth string is "user:password" as one)."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def prefect_header(creds: Credentials) -> dict[str, str]:
    user, _, password = creds.prefect_auth_string.partition(":")
    return basic_auth_header(user, password)
