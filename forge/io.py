"""Atomic file writes for run artifacts, appends that never leave half a line, and the check of a weight file.

Each writer puts the data in a temporary file in the destination's directory (same filesystem), flushes and
fsyncs it, then `os.replace`s it over the destination: a reader sees the old file or the new one, never a
half-written one. Parent directories are created. The directory itself is not fsynced, so after a power loss
the rename may be lost (the old file remains); that is enough for crash-safe resume and concurrent readers.

A full disk (ENOSPC), a quota (EDQUOT) or the file-size limit (EFBIG) met by any of these writes is a one-line
`DiskFull` naming the file and the bytes the write needed; the destination is as it was (an append is cut back to
the file's length before it).

`safetensors_problem(path)` says why a file is not a whole safetensors file (the 8-byte header length, the JSON
header and every tensor's byte range against the file's size; no tensor is read), and `check_safetensors` turns
that into a one-line UserError naming the file: every weight file read from a path a user gave goes through it.

`read_retrying(path, read)` tries a read again when the storage fails (an OSError that is not the file's absence:
EIO, a stale network handle), READ_ATTEMPTS times in all, and then raises a `StorageError`: the readers a resume
depends on (checkpoint files, `latest`, metrics.jsonl) use it. Only the read is retried, never the check of what
was read: a damaged file is damaged on every read.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from forge.errors import DiskFull, UserError, absent, storage_error

# A read the storage failed is tried 3 times in all, 0.2 s then 0.4 s apart (0.6 s at most per file). The faults a
# retry cures (a network or FUSE mount reconnecting, an NFS RPC retried, a disk's read retried after a bus reset)
# pass within a fraction of a second; an outage lasts minutes, and more tries would only delay its one line (the
# user's next --resume is the retry for that). A resume reads about ten such files.
READ_ATTEMPTS = 3
READ_BACKOFF_S = 0.2  # before the second try; doubled before each next one
T = TypeVar("T")

# no space, over a quota, over the process's file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored)
FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def human_bytes(n: int) -> str:
    """`n` bytes for a person: 512 B, 12.3 kB, 4.5 MB, 1.2 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def disk_full(path: str | Path, e: OSError, need: int) -> DiskFull:
    """The one-line error for a write of `need` bytes to `path` that the disk (or a limit) refused."""
    return DiskFull(
        f"cannot write '{path}': {e.strerror or os.strerror(e.errno)} (the write needed {human_bytes(need)}); free "
        "space (or raise the quota / file-size limit), then --resume"
    )


@contextlib.contextmanager
def space_for(path: str | Path, need: int):
    """Turn a full disk (or a file-size limit) met inside the block into `disk_full(path, ..., need)`."""
    try:
        yield
    except OSError as e:
        if e.errno not in FULL:
            raise
        raise disk_full(path, e, need) from None


@functools.cache
def umask() -> int:
    """This process's umask, read without changing it (`os.umask` sets it, a race with other threads' files).

    >>> 0 <= umask() <= 0o777
    True
    """
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(x for x in status if x.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically, with the mode a plain `open` would give it (0644 under umask 022, 0600
    under 077: a user who keeps their files private keeps the run's private too)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with space_for(path, len(data)), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp creates 0600; the dashboard, as the same user, reads them
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


def append_text(path: str | Path, text: str) -> None:
    """Append `text` (UTF-8) to `path` with unbuffered writes; a write the disk refuses is cut back to the file's
    length before it (no half line is left) and raised as `DiskFull`."""
    data = memoryview(text.encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError as e:
            if e.errno not in FULL:
                raise
            os.ftruncate(fd, start)  # cutting a file shorter is allowed on a full disk and under the size limit
            raise disk_full(path, e, len(text.encode("utf-8"))) from None
    finally:
        os.close(fd)


def truncate_jsonl(path: str | Path, step: int) -> None:
    """Keep the lines of JSONL file `path` whose `step` is at most `step`, byte for byte; drop the others and any
    line that is not a JSON object with an integer step (a torn last line). Nothing to drop: not rewritten."""
    path = Path(path)
    if not path.exists():
        return
    data = read_retrying(path, path.read_bytes)
    kept = b"".join(line + b"\n" for line in data.split(b"\n") if 0 <= _line_step(line) <= step)
    if kept != data:
        atomic_write_bytes(path, kept)


def _line_step(line: bytes) -> int:
    try:
        row = json.loads(line.decode("utf-8"))
    except ValueError:
        return -1
    return row["step"] if isinstance(row, dict) and isinstance(row.get("step"), int) else -1


def read_retrying(path: str | Path, read: Callable[[], T]) -> T:
    """`read()`, the read of `path`, tried again when the storage fails it (any OSError but the file's absence),
    READ_ATTEMPTS times in all with READ_BACKOFF_S doubling between; then a StorageError naming `path`. The file's
    absence (ENOENT, ENOTDIR) is raised at once as it came, and so is any other exception (what was read is damaged:
    a retry would read the same)."""
    attempt = 1
    while True:
        try:
            return read()
        except OSError as e:
            if absent(e):
                raise
            if attempt >= READ_ATTEMPTS:
                raise storage_error(path, e, attempt) from None
        time.sleep(READ_BACKOFF_S * 2 ** (attempt - 1))
        attempt += 1


def read_text_retrying(path: str | Path) -> str:
    """The UTF-8 text of `path`, read by `read_retrying`."""
    return read_retrying(path, functools.partial(Path(path).read_text, encoding="utf-8"))


def _header_bytes(path: str | Path) -> tuple[int, int, bytes]:
    """(the file's size, the header length its first 8 bytes give, the header's bytes: b"" when it cannot fit)."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return size, length, f.read(length) if size >= 8 and length <= size - 8 else b""


def safetensors_problem(path: str | Path) -> str:
    """Why `path` is not a whole safetensors file ("" when it is): its header length, JSON header and tensor byte
    ranges are checked against the file's size; no tensor is read. The storage failing the read (after
    `read_retrying`'s tries) is a StorageError, not a problem of the file."""
    try:
        size, length, head = read_retrying(path, functools.partial(_header_bytes, path))
    except OSError as e:  # absent
        return f"cannot be read: {e.strerror or e}"
    if size < 8 or length > size - 8:
        return f"truncated: {size} bytes, shorter than its header says"
    try:
        header = json.loads(head.decode("utf-8"))
    except ValueError:  # json and unicode errors
        return "its header is not valid JSON (truncated or not a safetensors file)"
    try:
        ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        return "its header does not describe tensors (not a safetensors file)"
    have, need = size - 8 - length, max(ends, default=0)
    cut = "truncated: " if have < need else ""
    return "" if need == have else f"{cut}its tensors need {need} bytes of data and the file holds {have}"


def check_safetensors(path: str | Path, fix: str) -> None:
    """A UserError naming `path`, why it is damaged and `fix` (what to do), unless it is a whole safetensors file."""
    if why := safetensors_problem(path):
        raise UserError(f"weight file '{path}' is damaged ({why}): {fix}")
