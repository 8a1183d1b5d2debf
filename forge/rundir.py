"""Run-directory bookkeeping shared by the recipes: claim, status.json, samples.jsonl, run tags, progress bar.

status.json says running / failed (with the error) / finished; summary.json is written only on completion, so a
half-written run never looks complete. samples.jsonl keeps a few completions per step for inspection.
`track_run_start` hands a tracker what identifies a run: tags (preset, model, dataset hash, git commit), the
flattened config as params, and config.yaml / plan.json / data/manifest.json as artifacts.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import torch

from forge.errors import UserError
from forge.io import atomic_write_text, write_json
from forge.records import ScoredBatch
from forge.tracking import Tracker

SAMPLES_PER_STEP = 8


def append_samples(run_dir: Path, step: int, rows: list[dict], batch: ScoredBatch) -> list[dict]:
    """A few completions per step (the first group) with their per-verifier scores, for inspection; returns them."""
    ro, g = batch.rollouts, batch.rollouts.group_size
    samples = []
    for i in range(min(SAMPLES_PER_STEP, ro.num_completions)):
        scores = {n: _num(batch.scores[i, v]) for v, n in enumerate(batch.verifier_names)}
        samples.append(
            {
                "step": step,
                "prompt": rows[i // g]["prompt"],
                "answer": rows[i // g].get("answer"),
                "completion": ro.texts[i],
                "scores": scores,
                "reward": _num(batch.rewards[i]),
                "advantage": _num(batch.advantages[i]),
            }
        )
    with (run_dir / "samples.jsonl").open("a") as f:
        f.write("".join(json.dumps(s) + "\n" for s in samples))
    return samples


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def truncate_samples(run_dir: Path, step: int) -> None:
    path = run_dir / "samples.jsonl"
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if _line_step(line) <= step]
        atomic_write_text(path, "".join(line + "\n" for line in keep))


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 30


def claim_run_dir(run_dir: Path, resume: bool) -> None:
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"cannot resume '{run_dir}': no such run (config.yaml missing)")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(
            f"run directory '{run_dir}' already exists: pass --resume to continue it or choose another --name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)


def write_status(run_dir: Path, state: str, step: int = 0, error: str = "") -> None:
    status = {"state": state, "step": step, "updated": time.time()}
    if error:
        status["error"] = error
    write_json(run_dir / "status.json", status)


def track_run_start(tracker: Tracker, cfg, run_dir: Path) -> None:
    """Tags, params (the resolved config, flattened) and the run's defining files, for the tracker."""
    tracker.set_tags(run_tags(cfg, run_dir))
    tracker.log_params(flatten(asdict(cfg)))
    for name, where in (("config.yaml", ""), ("plan.json", ""), ("data/manifest.json", "data")):
        if (run_dir / name).is_file():
            tracker.log_artifact(run_dir / name, where)


def run_tags(cfg, run_dir: Path) -> dict[str, str]:
    try:
        manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    tags = {
        "forgeweave.run_name": run_dir.name,
        "forgeweave.run_dir": str(run_dir.resolve()),
        "forgeweave.preset": cfg.preset,
        "forgeweave.model": cfg.model.path,
        "forgeweave.dataset_hash": manifest.get("content_hash", ""),
    }
    commit = git_commit()
    if commit:
        tags.update({"forgeweave.git_commit": commit, "mlflow.source.git.commit": commit})
    return tags


def git_commit() -> str:
    """The commit of the forgeweave checkout this code runs from; "" when it is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def progress_bar(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="grpo", unit="step", dynamic_ncols=True)


def update_bar(bar, metrics: dict, last_eval: dict | None) -> None:
    if bar is None:
        return
    post = {"reward": f"{metrics['reward/mean']:.3f}"}
    if last_eval:
        post["eval_pass@1"] = f"{last_eval['pass@1']:.3f}"
    bar.set_postfix(post)
    bar.update(1)


def run_summary(cfg, run_dir: Path, state, wall: float) -> dict:
    """summary.json's content: `state` is the recipe's RunState (step, seconds, initial_eval, last_eval)."""

    def brief(report):
        return {k: v for k, v in (report or {}).items() if k.startswith("pass@") or k in ("step", "mean_reward")}

    seconds = {**{k: round(v, 3) for k, v in state.seconds.items()}, "total": round(wall, 3)}
    return {
        "run": run_dir.name,
        "preset": cfg.preset,
        "model": cfg.model.path,
        "steps": state.step,
        "run_dir": str(run_dir.resolve()),
        "eval": {"initial": brief(state.initial_eval), "final": brief(state.last_eval)},
        "seconds": seconds,
    }
