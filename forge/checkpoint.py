"""Checkpoints: an HF model directory plus the trainer state needed for an exact resume.

Layout: `checkpoints/step-NNNNNN/` holds `config.json`, `model.safetensors`, tokenizer files and
`trainer_state.pt` (optimizer, adaptive-LR state, step, policy version, RNG states, data-sampler cursor,
eval score). Each directory is written under a temporary name and renamed into place, and `checkpoints/latest`
(a text file naming the directory) is replaced atomically afterwards: a crash leaves the previous
checkpoint intact and `latest` never points at a half-written one.

Retention keeps the `keep_last` newest plus the `keep_best` best by eval pass@1.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from forge.io import atomic_write_text, write_json

STATE_FILE = "trainer_state.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, model, tokenizer, state: dict, eval_score: float | None = None) -> Path:
    """Write checkpoint `step` under root (= run_dir/checkpoints) atomically and point `latest` at it."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({**state, "step": step, "rng": rng_state(), "eval_score": eval_score}, tmp / STATE_FILE)
        write_json(tmp / "checkpoint.json", {"step": step, "eval_pass@1": eval_score})
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_text(root / "latest", final.name + "\n")
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / STATE_FILE, weights_only=False, map_location="cpu")  # never onto a GPU


def read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as one state dict (tied copies appear once)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def load_weights(model, ckpt: Path) -> None:
    """Copy the checkpoint's weights into `model` in place (keeps the optimizer's parameter identity)."""
    assign_weights(model, read_weights(ckpt), source=str(ckpt))


def assign_weights(model, state: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy a full state dict into `model` in place; tied copies (e.g. lm_head) may be missing from `state`."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k}
    assert not (set(missing) - tied) and not unexpected, f"{source} does not match the model"
    if tied:
        model.tie_weights()


def apply_retention(root: Path, keep_last: int, keep_best: int) -> list[Path]:
    """Delete checkpoints outside keep_last newest + keep_best best (never the one `latest` names)."""
    dirs = sorted(p for p in root.glob("step-*") if p.is_dir())
    keep = set(dirs[-keep_last:]) if keep_last > 0 else set()
    scored = [(d, _score(d)) for d in dirs]
    scored = [(d, s) for d, s in scored if s is not None]
    scored.sort(key=lambda ds: (-ds[1], ds[0].name))
    keep |= {d for d, _ in scored[:keep_best]}
    latest = latest_checkpoint(root)
    if latest is not None:
        keep.add(latest)
    removed = [d for d in dirs if d not in keep]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def _score(ckpt: Path) -> float | None:
    try:
        return json.loads((ckpt / "checkpoint.json").read_text()).get("eval_pass@1")
    except (OSError, ValueError):
        return None
