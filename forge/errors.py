"""Errors meant for people: the CLI prints their message as one line, without a traceback."""

import errno


class UserError(Exception):
    """Bad input a user can fix (file, config key, path). The message names what and says what to do."""


class DiskFull(UserError):
    """A write the disk refused (no space, a quota, the file-size limit): the message names the path and the bytes
    it needed. The failure path's own bookkeeping writes may meet it too and then stay silent (forge.loop)."""


class StorageError(UserError):
    """A read the storage failed (an I/O error, a stale network handle), not a damaged file: whoever meets it stops
    and changes nothing (a resume does not fall back to an older checkpoint, cut the run's records or let retention
    delete checkpoints); the message names the path and says to retry once the storage answers."""


# errno values that mean "the file is not there" (a missing or damaged checkpoint), not "the storage failed"
ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})


def absent(e: OSError) -> bool:
    """Whether `e` says the file is not there (ENOENT, ENOTDIR; also a FileNotFoundError without an errno, as
    safetensors raises it), not that the storage failed."""
    return e.errno in ABSENT_ERRNOS or isinstance(e, (FileNotFoundError, NotADirectoryError))


def storage_error(path, e: OSError, tries: int = 1) -> StorageError:
    """The one line for a failed read of `path` that is not the file's absence (`tries`: the reads that failed)."""
    tried = f" ({tries} reads failed)" if tries > 1 else ""
    return StorageError(f"{path}: {e.strerror or e} while reading it: the storage failed, not the file{tried}; retry "
                        "once it answers (nothing was changed)")  # fmt: skip
