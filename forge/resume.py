"""What a `--resume` needs, checked before the resumed run writes anything into its directory.

`check_resumable(run_dir)` reads (never writes) every file a resume depends on: the checkpoint to continue from
(`forge.checkpoint.resume_checkpoint`: the one `checkpoints/latest` names when it is intact, else the newest intact
`step-NNNNNN`, with one stderr line saying which and why; none intact is a UserError), its trainer state (JSON +
safetensors) and weight-file headers, `metrics.jsonl` (every line but a torn last one must be a metrics row), the
data splits and the probe set, if any (readable parquet whose content hash matches data/manifest.json and the
checkpoint). Any problem is a one-line UserError naming the file, raised while the directory is still exactly as it
was. Returns the checkpoint directory, or None when the run has no step directory at all (it was stopped before its
first checkpoint: the recipe starts it again from step 0). A second process on the run (`forge.rundir.RunLock`) is
refused here too, before anything is written.

A resume may change the config (`--resume --set update.lr=...`): `forge.compose.resume_changes` compares it with the run's
config.yaml and refuses a change the checkpoint cannot honour (`RESUME_FIXED`: seed, model.*, data.*,
the reward ensemble's keys; also steps below the checkpoint's step), still before anything is written;
`forge.compose.record_changes` then rewrites config.yaml (atomically) and appends `{step, time, changes: {key: [old, new]}}` to
config_changes.jsonl, one line per resume that changed something.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from forge.checkpoint import load_state, resume_checkpoint
from forge.config_base import ConfigError, require
from forge.data import check_data_hash, read_probe, read_split
from forge.io import atomic_write_text
from forge.rundir import CHANGES, note_stale, refuse_if_locked
from forge.tracking import read_metrics

# keys a resume may not change: the checkpoint's state means something only under them (key or section prefix
# ending in '.' -> why); every other key (steps, update.lr, eval.*, checkpoint.*, tracking.*, ...) may change
RESUME_FIXED: dict[str, str] = {
    "seed": "it seeded the data split, the prompt order and the initial weights of the saved run",
    "model.": "the checkpoint holds this model's weights, and data/ holds prompts formatted for it",
    "data.": "data/*.parquet were prepared from these settings (and the checkpoint checks their hash)",
    "reward.verifiers": "the saved reward state and the run's reward metrics are per verifier",
    "reward.aggregate": "the saved reward state (the ensemble's window and fit) and the run's rewards belong to "
    "this aggregation",
    "reward.ensemble.model": "the saved ensemble fit is of this model",
    "reward.ensemble.classes": "the saved ensemble fit has this many classes",
    "reward.ensemble.necessary_checks": "the saved ensemble fit was made with these checks",
    "reward.label_free": "the saved ensemble window holds scores made with (or without) the answers",
    "collapse.probe_source": "data/probe.parquet was prepared from it (and the checkpoint checks its hash)",
}
# model keys that change how the update computes, not what the weights are
RESUME_FREE = {"model.gradient_checkpointing", "model.attn_implementation"}


def check_resume_changes(changes: dict[str, list], step: int, steps: int) -> None:
    """Refuse (one-line ConfigError naming the key) a change a resume from checkpoint `step` cannot honour."""
    for key in changes:
        fixed = next((p for p in RESUME_FIXED if key == p or (p.endswith(".") and key.startswith(p))), None)
        if fixed is not None and key not in RESUME_FREE:
            old, new = changes[key]
            raise ConfigError(
                f"config key '{key}' cannot change on --resume ({old!r} -> {new!r}): {RESUME_FIXED[fixed]}; "
                "start a new run with --config runs/NAME/config.yaml --set ... instead"
            )
    require(steps >= step, "steps", f"is {steps}, below the checkpoint's step {step}: set steps >= {step}")


def check_resumable(run_dir: Path) -> Path | None:
    """The checkpoint a resume of `run_dir` continues from (None: none yet), after checking that no other process
    holds the run and what a resume reads; says so on stderr when the last process died without finishing."""
    run_dir = Path(run_dir)
    refuse_if_locked(run_dir)
    if (run_dir / "metrics.jsonl").is_file():
        read_metrics(run_dir / "metrics.jsonl", strict=True)
    ckpt, why = resume_checkpoint(run_dir / "checkpoints")  # intact: files readable, weight headers whole
    if ckpt is not None:
        saved = load_state(ckpt)
        train, eval_ = read_split(run_dir, "train"), read_split(run_dir, "eval")
        check_data_hash(run_dir, train, eval_, saved.get("data_hash"), read_probe(run_dir))
    note_stale(run_dir)
    if ckpt is None:
        reason = f" ({why})" if (run_dir / "checkpoints" / "latest").is_file() else ""
        print(f"forgeweave: {run_dir.name} has no checkpoint yet{reason}: starting it from step 0", file=sys.stderr)
    elif why:
        print(f"forgeweave: {run_dir.name}: {why}", file=sys.stderr)
    return ckpt


def write_changes(run_dir: Path, config_yaml: str, changes: dict[str, list], step: int) -> None:
    """config.yaml := `config_yaml` (the resumed run's config), then one line `{step, time, changes}` appended to
    config_changes.jsonl (both atomic). `forge.compose.record_changes` calls it with the run config."""
    atomic_write_text(run_dir / "config.yaml", config_yaml)
    path = run_dir / CHANGES
    before = path.read_text(encoding="utf-8") if path.is_file() else ""
    line = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "changes": changes}
    atomic_write_text(path, before + json.dumps(line) + "\n")


def checkpoint_step(ckpt: Path | None) -> int:
    """The step of a `step-NNNNNN` checkpoint directory (0 for None: a run that starts over)."""
    return int(Path(ckpt).name.removeprefix("step-")) if ckpt is not None else 0
