"""A prepared run's data read back and checked: `read_split`, `read_probe`, `train_row_count`, and the content
hash (`content_hash`, `check_data_hash`) that keeps a run on the data it started with.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from forge.errors import UserError


def content_hash(train: list[dict], eval_: list[dict], probe: list[dict] | None = None) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces, UTF-8) of both splits (and the probe rows, when there
    are any: without them the hash is what it always was); values JSON has no form for (dates, bytes, decimals) are
    written as their ISO / hex / str text."""
    splits = {"train": train, "eval": eval_, **({"probe": probe} if probe else {})}
    canonical = json.dumps(splits, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=_canonical)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _canonical(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def read_split(run_dir: Path, split: str) -> list[dict]:
    """Rows of run_dir/data/{split}.parquet ('train', 'eval' or 'probe') as dicts, each column with its stored
    type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(run_dir) / "data" / f"{split}.parquet"
    if not path.is_file():
        raise UserError(f"{path} does not exist; run the prep stage first")
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        first_line = str(e).strip().split("\n")[0]
        raise UserError(
            f"{path}: not a readable parquet file ({first_line}); the run's data is damaged: start a new run"
        ) from None


def read_probe(run_dir: Path) -> list[dict] | None:
    """The probe rows of a prepared run (data/probe.parquet), None when it has no probe set."""
    return read_split(run_dir, "probe") if (Path(run_dir) / "data" / "probe.parquet").is_file() else None


def train_row_count(run_dir: Path) -> int:
    """Training rows of a prepared run (data/manifest.json), 0 when it cannot be read."""
    try:
        return int(json.loads((Path(run_dir) / "data" / "manifest.json").read_text(encoding="utf-8"))["train_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def check_data_hash(
    run_dir: Path, train: list[dict], eval_: list[dict], saved: str | None = None, probe: list[dict] | None = None
) -> str:
    """The splits' (and probe rows') content hash, checked against data/manifest.json and (on resume) the
    checkpoint's `saved` one: a run never continues on data other than what it started with. Raises UserError
    naming the file."""
    manifest = Path(run_dir) / "data" / "manifest.json"
    try:
        expected = json.loads(manifest.read_text(encoding="utf-8"))["content_hash"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{manifest}: missing or unreadable ({type(e).__name__}); the run's data is damaged: start a new run"
        ) from None
    actual = content_hash(train, eval_, probe)
    splits = "train/eval/probe splits" if probe else "train/eval splits"
    for what, want in (("data/manifest.json", expected), ("the checkpoint", saved)):
        if want is not None and want != actual:
            raise UserError(
                f"{Path(run_dir) / 'data'}: the {splits} changed since {what} was written "
                f"(hash {actual[:12]} != {want[:12]}); restore the run's own data or start a new run"
            )
    return actual
