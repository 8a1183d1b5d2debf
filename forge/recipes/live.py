"""Live state: what a GRPO run carries between stages, on disk, so each stage can run in another process.

In distributed execution every stage is a separate process (a Prefect worker's flow run, possibly on another
machine sharing the run directory). Before a stage it attaches: builds the run's components from config.yaml and
the prepared data (`GRPORun.build`), then `load_live` restores what earlier stages changed; a stage that changes
anything calls `save_live` after it. Stages run one at a time, so there is exactly one writer.

Layout under the run directory:
- `live/policy.pt`: policy weights and trainer state (optimizer, adaptive LR, step, policy version); rewritten
  only by stages that change them (prepare, update).
- `live/cursor.pt`: data sampler cursor, ensemble window, RNG states; small, rewritten by every stage that moves
  them. Both are written by the stage processes only.
- `live/run_state.json`: the loop's `RunState` (step, seconds per stage, initial and last eval). Written by the
  driver (and by the prepare stage), read by everyone.
- `steps/step-NNNNNN/<stage>.pt`: one stage's output for the next stage (rows + rollouts, scored batch, update
  stats, eval report), with the seconds it took and where it ran (host, pid, parent pid).
Both files are written atomically (temporary file + rename); the RNG restore makes a distributed run compute
exactly what the in-process loop computes for the same config.
"""

from __future__ import annotations

import io
import json
import os
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from forge.checkpoint import rng_state, set_rng_state, step_dir_name
from forge.io import atomic_write_bytes, write_json
from forge.recipes.grpo import GRPORun, RunState

POLICY = Path("live") / "policy.pt"
CURSOR = Path("live") / "cursor.pt"
RUN_STATE = Path("live") / "run_state.json"


def save_live(grpo: GRPORun, policy: bool = True) -> None:
    """Write what a stage may have changed (see the module docstring); `policy=False`: weights and optimizer are
    unchanged, skip rewriting them."""
    if policy:
        _save_torch(
            grpo.run_dir / POLICY, {"model": grpo.trainer.unwrapped.state_dict(), "trainer": grpo.trainer.state_dict()}
        )
    cursor = {
        "sampler": grpo.sampler.state_dict(),
        "aggregator": grpo.aggregator.state_dict() if grpo.aggregator is not None else None,
        "rng": rng_state(),
    }
    _save_torch(grpo.run_dir / CURSOR, cursor)


def load_live(grpo: GRPORun) -> None:
    """Restore components and RunState into a freshly built GRPORun; the rollout backend gets the weights."""
    policy = torch.load(grpo.run_dir / POLICY, weights_only=False)
    cursor = torch.load(grpo.run_dir / CURSOR, weights_only=False)
    grpo.trainer.unwrapped.load_state_dict(policy["model"])
    grpo.trainer.load_state_dict(policy["trainer"])
    grpo.sampler.load_state_dict(cursor["sampler"])
    if grpo.aggregator is not None and cursor["aggregator"] is not None:
        grpo.aggregator.load_state_dict(cursor["aggregator"])
    set_rng_state(cursor["rng"])
    grpo.backend.sync_weights(grpo.trainer.unwrapped, grpo.trainer.policy_version)
    grpo.state = read_run_state(grpo.run_dir)


def write_run_state(run_dir: Path, state: RunState) -> None:
    write_json(run_dir / RUN_STATE, asdict(state))


def read_run_state(run_dir: Path) -> RunState:
    return RunState(**json.loads((run_dir / RUN_STATE).read_text()))


def save_stage_output(run_dir: Path, step: int, stage: str, output: dict[str, Any]) -> Path:
    """`output` plus where it ran, to steps/step-N/<stage>.pt (atomically)."""
    where = {"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid()}
    path = run_dir / "steps" / step_dir_name(step) / f"{stage}.pt"
    _save_torch(path, {**output, "where": where})
    return path


def load_stage_output(run_dir: Path, step: int, stage: str) -> dict[str, Any]:
    path = run_dir / "steps" / step_dir_name(step) / f"{stage}.pt"
    if not path.is_file():
        raise RuntimeError(f"stage {stage} of step {step} finished without writing {path}")
    return torch.load(path, weights_only=False)


def _save_torch(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())
