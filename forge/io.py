"""Atomic file writes for run artifacts.

Each writer puts the data in a temporary file in the destination's directory (same filesystem), flushes and
fsyncs it, then `os.replace`s it over the destination: a reader sees the old file or the new one, never a
half-written one. Parent directories are created. The directory itself is not fsynced, so after a power loss
the rename may be lost (the old file remains); that is enough for crash-safe resume and concurrent readers.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (mode 0644)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts are read by other processes (dashboard)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` as UTF-8 to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON (UTF-8, trailing newline) to `path` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
