"""`forgeweave export`: which checkpoint a request means, a clean HF model directory of it, an optional hub upload.

A request names a run (under --runs-dir, or its directory) and optionally a step (default: the checkpoint `latest`
names), or a checkpoint directory itself. The export (`forge.checkpoint.export_hf_dir`) merges a LoRA adapter into
the base model the run's config.yaml describes. `--push-to-hub` is refused before anything is written when the
hub is switched off (HF_HUB_OFFLINE), unreachable or refuses the token (one `whoami` request); the upload is one hub
commit, so a push that fails later leaves the hub repo as it was and the exported directory complete.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from forge.errors import UserError


def resolve_checkpoint(source: str, step: int | None, runs_dir: str) -> Path:
    """The checkpoint directory `source` (run name, run directory or checkpoint directory) and `step` mean."""
    from forge.checkpoint import resume_checkpoint, step_dir_name

    path = Path(source)
    if (path / "checkpoint.json").is_file():
        if step is not None:
            raise UserError(f"export: '{path}' is a checkpoint directory already; --step applies to a run")
        return path
    run = path if (path / "checkpoints").is_dir() else Path(runs_dir) / source
    root = run / "checkpoints"
    if not root.is_dir():
        raise UserError(
            f"export: '{source}' is not a forgeweave checkpoint (no checkpoint.json) nor a run (no {root}): pass a "
            "run name, a run directory or runs/NAME/checkpoints/step-N"
        )
    if step is None:  # a resume's rule: `latest` when intact, else the newest intact step (one line says so)
        ckpt, why = resume_checkpoint(root)
        if ckpt is None:
            raise UserError(f"export: run '{run}' has no checkpoint yet")
        if why:
            print(f"forgeweave: export: {why}", file=sys.stderr)
        return ckpt
    ckpt = root / step_dir_name(step)
    if not (ckpt / "checkpoint.json").is_file():
        have = sorted(p.name for p in root.glob("step-*") if (p / "checkpoint.json").is_file())
        raise UserError(f"export: run '{run}' has no checkpoint at step {step} (it has: {', '.join(have) or 'none'})")
    return ckpt


def run_config(ckpt: Path):
    """The config of the run holding `ckpt` (`<run>/checkpoints/step-N`), or None outside a run."""
    from forge.config import load_yaml

    path = Path(ckpt).resolve().parent.parent / "config.yaml"
    return load_yaml(path) if path.is_file() else None


def export(ckpt: Path, out: Path | None, push_to_hub: str | None = None) -> Path:
    """Export `ckpt` to the new directory `out` (None: a full-weights checkpoint gets its model.safetensors in
    place, as before) and push it to hub repo `push_to_hub` if given. Returns what was written."""
    from forge.checkpoint import export_hf_dir, export_model, is_adapter

    if push_to_hub:
        check_online(push_to_hub)
    if out is None:
        if push_to_hub or is_adapter(ckpt):
            raise UserError("export: give OUT, the new HF model directory to write")
        return export_model(ckpt)
    cfg = run_config(ckpt)
    written = export_hf_dir(ckpt, out, cfg.model if cfg else None, cfg.seed if cfg else 0)
    if push_to_hub:
        push(written, push_to_hub)
    return written


def check_online(repo_id: str) -> None:
    """Before anything is written: the hub is switched on, reachable, and knows the token (one request)."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        raise UserError(
            f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set, so nothing was exported or pushed; unset it "
            "(and log in with `hf auth login`) where the hub is reachable"
        )
    from huggingface_hub import HfApi

    try:
        HfApi().whoami()
    except Exception as e:  # unreachable, or no / a wrong token
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"--push-to-hub {repo_id}: the hub cannot be used from here ({type(e).__name__}: {first}), so nothing "
            "was exported or pushed; check the network and `hf auth login`, or export without --push-to-hub"
        ) from None


def push(folder: Path, repo_id: str) -> None:
    """Upload `folder` as one commit to hub model repo `repo_id` (created if missing)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          commit_message="forgeweave export")  # fmt: skip
    except Exception as e:  # network, auth, a bad repo id: the hub's own error text, on one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"--push-to-hub {repo_id}: the upload failed ({type(e).__name__}: {first}); '{folder}' is complete: "
            f"push it later with `hf upload {repo_id} {folder}`"
        ) from None
