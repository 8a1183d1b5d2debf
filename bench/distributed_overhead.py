"""Distributed execution overhead: the same tiny config in-process vs every stage on a Prefect worker.

Starts a private Prefect server on 127.0.0.1 and one process worker per work pool (two pools: gen for rollout,
reward and evaluate; train for prep and update), runs `forgeweave run` distributed, then the same config with
--no-prefect, and prints wall seconds per step for both, the ratio, and the mean seconds of each stage's flow run
as the workers saw them (process start + attach + the stage). Everything it starts is stopped by PID.
Usage: python bench/distributed_overhead.py [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forge.config import to_dict  # noqa: E402
from forge.presets import tiny  # noqa: E402
from tests.servers import BIN, free_port, start, stop, wait_http  # noqa: E402

POOLS = [
    {"name": "gen", "kind": "cpu", "work_pool": "bench-gen", "stages": ["rollout", "reward", "evaluate"]},
    {"name": "train", "kind": "cpu", "work_pool": "bench-train", "stages": ["update", "prep"]},
]


def write_config(path: Path, steps: int, distributed: bool) -> Path:
    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.eval.k, cfg.checkpoint.every = steps, steps, 0, steps
    cfg.pools = POOLS
    cfg.orchestration.execution = "distributed" if distributed else "embedded"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def timed_run(args: list[str], env: dict, log: Path) -> float:
    t = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([str(BIN / "forgeweave"), *args], env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"run failed (exit {rc}); see {log}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    steps = ap.parse_args().steps
    tmp = Path(tempfile.mkdtemp(prefix="fw-dist-bench-"))
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    server = start([str(BIN / "forgeweave"), "server", "--port", str(port)], env, tmp / "server.log")
    procs = [server]
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", 90)
        env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PYTHONPATH": str(REPO)}
        for p in POOLS:
            procs.append(
                start([str(BIN / "forgeweave"), "worker", "--pool", p["work_pool"]], env, tmp / f"{p['name']}.log")
            )
        runs = tmp / "runs"
        dist = timed_run(
            [
                "run",
                "--config",
                str(write_config(tmp / "d.yaml", steps, True)),
                "--name",
                "dist",
                "--runs-dir",
                str(runs),
                "--quiet",
            ],
            env,
            tmp / "dist.log",
        )
        plain = timed_run(
            [
                "run",
                "--config",
                str(write_config(tmp / "p.yaml", steps, False)),
                "--name",
                "plain",
                "--runs-dir",
                str(runs),
                "--quiet",
                "--no-prefect",
            ],
            env,
            tmp / "plain.log",
        )
    finally:
        for p in reversed(procs):
            stop(p)
    per_stage: dict[str, list[float]] = {}
    for out in (runs / "dist" / "steps").glob("step-*/*.pt"):
        per_stage.setdefault(out.stem, []).append(torch.load(out, weights_only=False)["seconds"])
    print(f"tiny preset, {steps} steps, 2 work pools x 1 process worker, {os.cpu_count()} cores")
    print(f"in-process (--no-prefect): {plain:7.1f} s wall  {plain / steps:6.2f} s/step (incl. start-up)")
    print(f"distributed:               {dist:7.1f} s wall  {dist / steps:6.2f} s/step  ratio {dist / plain:.1f}x")
    print("stage work inside the worker's flow run (attach + stage + save), mean seconds:")
    for stage, secs in sorted(per_stage.items()):
        print(f"  {stage:<11}{statistics.mean(secs):6.2f}  (n={len(secs)})")
    print(json.dumps({"steps": steps, "plain_s": round(plain, 1), "distributed_s": round(dist, 1)}))


if __name__ == "__main__":
    main()
