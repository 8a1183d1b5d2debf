"""Distributed execution for real: a Prefect server, two process work pools with one worker each, and a run whose
stages each land on the worker of the pool Weaver's plan gives them; the result equals the in-process run."""

from __future__ import annotations

import json

import torch
import yaml

from forge.config import to_dict
from forge.presets import tiny
from tests.servers import BIN, REPO, start, stop

POOLS = [
    {"name": "gen", "kind": "cpu", "work_pool": "fw-gen", "stages": ["rollout", "reward", "evaluate"]},
    {"name": "train", "kind": "cpu", "work_pool": "fw-train", "stages": ["update", "prep"]},
]
# flow stage -> the work pool whose worker must have run it (checkpoint goes with update, evaluate with rollout)
EXPECTED_POOL = {
    "prepare": "fw-train",
    "rollout": "fw-gen",
    "reward": "fw-gen",
    "update": "fw-train",
    "evaluate": "fw-gen",
    "checkpoint": "fw-train",
}


def _config(tmp_path, distributed: bool):
    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.eval.k, cfg.checkpoint.every = 2, 2, 0, 2
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 8, 8
    cfg.pools = POOLS
    cfg.orchestration.execution = "distributed" if distributed else "embedded"
    path = tmp_path / f"{'distributed' if distributed else 'embedded'}.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def _run(args: list[str], env: dict, log) -> int:
    import subprocess

    return subprocess.run([str(BIN / "forgeweave"), *args], env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def test_stages_run_on_their_pools_workers_and_match_the_in_process_run(prefect_server, tmp_path):
    api_url, env = prefect_server
    env = {**env, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = tmp_path / "runs"
    workers = {
        pool["work_pool"]: start(
            [str(BIN / "forgeweave"), "worker", "--pool", pool["work_pool"]], env, tmp_path / f"{pool['name']}.log"
        )
        for pool in POOLS
    }
    try:
        with open(tmp_path / "run.log", "w") as log:
            rc = _run(
                ["run", "--config", str(_config(tmp_path, True)), "--name", "dist", "--runs-dir", str(runs)], env, log
            )
        logs = "".join((tmp_path / f).read_text()[-2500:] for f in ("run.log", "gen.log", "train.log"))
        assert rc == 0, logs
    finally:
        for w in workers.values():
            stop(w)
    run_dir = runs / "dist"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["execution"] == "distributed" and summary["steps"] == 2
    # every stage ran in a child process of the worker of its planned pool
    seen = set()
    for out in sorted((run_dir / "steps").glob("step-*/*.pt")):
        where = torch.load(out, weights_only=False)["where"]
        stage = out.stem
        assert where["ppid"] == workers[EXPECTED_POOL[stage]].pid, (stage, where)
        seen.add(stage)
    assert seen == set(EXPECTED_POOL)
    # same numbers as the plain in-process recipe on the same config
    with open(tmp_path / "embedded.log", "w") as log:
        args = [
            "run",
            "--config",
            str(_config(tmp_path, False)),
            "--name",
            "emb",
            "--runs-dir",
            str(runs),
            "--no-prefect",
        ]
        assert _run(args, env, log) == 0
    embedded = json.loads((runs / "emb" / "summary.json").read_text())
    assert summary["eval"] == embedded["eval"]
    rows = [
        [json.loads(line) for line in (runs / n / "metrics.jsonl").read_text().splitlines()] for n in ("dist", "emb")
    ]
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        assert [r.get(key) for r in rows[0]] == [r.get(key) for r in rows[1]], key
