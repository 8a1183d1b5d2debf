"""The GPU device check (scripts/gpu_check.sh, scripts/gpu_check.py) where no GPU is: the shell script parses; the
bare-machine venv (scripts/gpu_bare_venv.py) holds the lent machine's packages and none of Ray/vLLM/Prefect/MLflow/
datasets/Streamlit; pyproject's dependencies are each on the machine, carried as a wheel, or left out on purpose; and
the dry run (`--dry-run`: that venv, the carried wheels only, tiny shapes on the CPU) passes and writes a JSON with
every section and its numbers, the bundle's size printed and under 60 MiB."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
WHEELS = REPO / ".gpu-wheels"
# pyproject dependencies the device check does without (scripts/gpu_wheels.txt says why)
LEFT_OUT = {"prefect", "mlflow", "streamlit", "ray", "datasets"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(path: Path) -> dict[str, str]:
    """name -> pinned version ('' unpinned) of a one-a-line list with # comments."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonical(n): v for n, _, v in (line.partition("==") for line in lines if line)}


def test_the_device_check_parses():
    out = subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_dependency_is_on_the_machine_carried_or_left_out_on_purpose():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {canonical(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0]) for d in deps}
    machine, carried = names(SCRIPTS / "gpu_machine_packages.txt"), names(SCRIPTS / "gpu_wheels.txt")
    assert declared - set(machine) - set(carried) == LEFT_OUT
    assert not set(carried) & set(machine), "a carried wheel shadows the machine's own package"
    # each carried wheel pinned to what this venv runs (so the dry run tests the versions that travel)
    assert {n: metadata.version(n) for n in carried} == carried


def test_the_bare_venv_has_the_machines_packages_and_not_ray_vllm_prefect_mlflow(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_bare_venv.py"), str(tmp_path / "venv")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    python = out.stdout.strip()
    probe = "import importlib.util as u; print([m for m in %r if u.find_spec(m)])"
    wanted = ("torch", "transformers", "accelerate", "safetensors", "peft", "pyarrow", "yaml", "numpy")
    absent = ("ray", "vllm", "prefect", "mlflow", "datasets", "streamlit", "math_verify", "gguf", "websockets")
    seen = subprocess.run([python, "-I", "-c", probe % (wanted + absent,)], capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert eval(seen.stdout) == list(wanted), seen.stdout  # the machine's, and nothing of the absent ones


@pytest.fixture(scope="module")
def wheels():
    """.gpu-wheels/ as `make gpu-wheels` makes it (downloaded once, from the registry, when missing or stale)."""
    want = set(names(SCRIPTS / "gpu_wheels.txt").items())
    have = {(canonical(w.name.split("-")[0]), w.name.split("-")[1]) for w in WHEELS.glob("*.whl")}  # name-version-...
    if have != want:
        out = subprocess.run(["make", "-s", "gpu-wheels", f"PYTHON={sys.executable}"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
    return WHEELS


@pytest.mark.slow
def test_the_dry_run_passes_in_the_bare_venv_and_writes_every_section(wheels, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    size = re.search(r"wheel bundle \.gpu-wheels: (\d+) wheels, \d+ KiB \(([\d.]+) MiB; limit 60 MiB\)", out.stdout)
    assert size and int(size[1]) == len(names(SCRIPTS / "gpu_wheels.txt")) and float(size[2]) < 60, out.stdout[:500]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    s = report["sections"]
    assert report["dry_run"] and report["bare"] and report["failed"] == []
    assert list(s) == ["env", "update", "rollout", "publish", "fsdp", "ckpt", "ray"]
    assert all(v["status"] == "ok" for k, v in s.items() if k != "ray"), {k: v.get("error") for k, v in s.items()}
    assert s["ray"]["status"] == "skipped"  # the bare venv has no Ray: skipped with a line, not failed
    env_ = s["env"]["result"]
    assert env_["importable_of_absent"] == [] and env_["bundle"]["under_limit"] and env_["bundle"]["mib"] < 60
    variants = s["update"]["result"]["variants"]
    assert {(v["micro_batch"] > 4, v["packing"], v["grad_ckpt"]) for v in variants} == {
        (m, p, c) for m in (False, True) for p in (False, True) for c in (False, True)
    }  # micro-batch sizes x packing x gradient checkpointing
    for v in variants + s["rollout"]["result"]["variants"] + [s["fsdp"]["result"]]:
        assert v["tokens_per_s"] > 0 and v["peak_gib"] > 0 and v["planned_gib"] > 0 and v["peak_over_planned"] > 0, v
        assert v["predicted_gib"] > 0 and v["peak_over_predicted"] > 0, v  # weaver.memory's, the planner's
    assert all(0 < v["mfu"] for v in variants) and s["fsdp"]["result"]["full_state_round_trip_equal"]
    p = s["publish"]["result"]
    assert p["bit_exact"] and p["ipc_seconds_per_sync"] > 0 and p["planned_extra_mib"] > 0
    assert p["single_rank_seconds_per_sync"] > 0 and p["gloo_pair_seconds_per_sync"] > 0
    assert p["receiver_extra_mib"] >= 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| update |") == 8 and table.count("| publish |") == 4 and "| fsdp (1 rank) |" in table
    assert "gpu_check: all sections passed" in out.stdout


def test_the_bare_check_fails_where_ray_or_prefect_can_be_imported(tmp_path):
    """--bare (what --dry-run passes) refuses an interpreter that could reach Ray/Prefect/...: this test's venv can."""
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--bare", "--only", "ckpt", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 1, (out.stdout + out.stderr)[-2000:]
    failed = json.loads((tmp_path / "gpu_check.json").read_text())["failed"]
    assert len(failed) == 1 and failed[0].startswith("env (bare: ray, ") and "prefect" in failed[0], failed
