"""Publishing policy weights between processes: one safetensors file per publication, labelled with its version.

The trainer (rank 0) writes `policy.safetensors` into a publication directory; a rollout process in another
process (the main pipeline when the update runs on its own ranks, or a vLLM worker) loads it before the next
rollout. The file is written to a temporary name and renamed into place, so a reader never sees a torn file,
and the policy version travels inside the file's metadata: a reader can check it sampled from the version it
was told to, which makes stale weights detectable by construction.

`publication_dir(run_dir)` prefers `/dev/shm` (a RAM-backed filesystem on Linux) and falls back to
`run_dir/weights` where it is absent; on a cluster the run directory is the shared store.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

WEIGHTS_FILE = "policy.safetensors"
_SHM = Path("/dev/shm")


def publication_dir(run_dir: Path, shared_memory: bool = True) -> Path:
    """Where a run publishes its weights: /dev/shm/forgeweave-<run>-<hash> when possible, else run_dir/weights."""
    run_dir = Path(run_dir).resolve()
    if shared_memory and _SHM.is_dir() and os.access(_SHM, os.W_OK):
        tag = f"{run_dir.name}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}"
        return _SHM / f"forgeweave-{tag}"
    return run_dir / "weights"


def publish_weights(model_or_state: torch.nn.Module | dict, directory: Path, version: int) -> Path:
    """Atomically write the weights (fp32 or their own dtype, contiguous, on CPU) labelled `version`."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    tensors = _unshared({k: v.detach().cpu().contiguous() for k, v in state.items()})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / WEIGHTS_FILE
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{WEIGHTS_FILE}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"policy_version": str(int(version))})
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def published_version(path: Path) -> int:
    """The policy version stored in a published weights file (without reading the tensors)."""
    with safe_open(str(path), framework="pt") as f:
        return int((f.metadata() or {})["policy_version"])


def load_published(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """(state dict, policy version) of a published weights file."""
    return load_file(str(path)), published_version(path)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (tied embeddings): keep the first name of each storage."""
    seen: dict[tuple[int, int], str] = {}
    out = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out
