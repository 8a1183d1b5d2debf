"""Reading a data source into rows: files, `datasets` directories, directories and globs of data files.

A .jsonl / .json (a list of objects) / .csv / .parquet file is read here with the standard library and pyarrow; a
Hugging Face `datasets` directory written by `save_to_disk` (a Dataset, or a DatasetDict: `data.split` and
`data.eval_split` pick the splits), or a directory or glob of data files, is read through `datasets`
(`datasets.load_dataset(<builder>, data_files=...)` with a throwaway cache; `datasets` is imported only for those).
JSON is read strictly (`strict_json_loads`: no duplicate keys, no NaN/Infinity). Errors name the file and line and
say what to do; checking each row is left to forge.data.validate.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge.errors import UserError

_DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def load_rows(
    path: str | Path,
    prompt_column: str,
    answer_column: str | None,
    split: str = "train",
    split_key: str = "data.split",
) -> list[dict]:
    """Read a data source into a list of dicts, values as stored (typed where the format has types).

    A .jsonl / .json (a list of objects) / .csv / .parquet file is read here; a `datasets` save_to_disk
    directory, or a directory or glob of data files, through `datasets` (`split` picks a DatasetDict's split;
    `split_key` is the config key that named it, for errors). Raises UserError for a missing source, an unknown
    extension, an unparsable line or item (naming file and line), an empty source, or a prompt/answer column
    that no row has (answer_column None: the answer column is not required, see `forge.data.splits._labelled`).
    Per-row problems are left to `validate_rows`. Blank .jsonl lines are skipped, so row N is the Nth object (for
    .csv, the Nth record after the header).
    """
    p = Path(path)
    if p.is_dir() or is_glob(str(path)):
        rows, columns = _read_datasets(str(path), split, split_key)
    else:
        if not p.is_file():
            raise UserError(f"data source '{p}' does not exist; check data.source / data.eval_source")
        reader = _READERS.get(p.suffix.lower())
        if reader is None:
            raise UserError(
                f"{p}: unknown extension '{p.suffix}'; use .jsonl, .json, .csv or .parquet, a `datasets` "
                "directory, or a directory/glob of such files"
            )
        rows, columns = reader(p)
    if not rows:
        raise UserError(f"{path}: the source has no rows; add some or point data.source elsewhere")
    for column, key in ((prompt_column, "data.prompt_column"), (answer_column, "data.answer_column")):
        if column is not None and column not in columns:
            raise UserError(no_column_message(path, column, columns, key))
    return rows


def no_column_message(path: str | Path, column: str, columns: list[str], fix: str) -> str:
    found = ", ".join(repr(c) for c in list(columns)[:10])
    return f"{path}: no column '{column}' in any row (found {found}); set {fix}"


def source_label(source: str, split: str | None) -> str:
    """How errors and row ids name a source: the path, plus ':split' for a DatasetDict's split."""
    return f"{source}:{split}" if split and is_dataset_dict(source) else source


def is_dataset_dict(source: str) -> bool:
    return (Path(source) / "dataset_dict.json").is_file()


def is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


def _read_datasets(source: str, split: str, split_key: str) -> tuple[list[dict], list[str]]:
    """Rows of a save_to_disk directory (Dataset or DatasetDict split) or of a directory/glob of data files."""
    p = Path(source)
    if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        ds = _load_from_disk(p)
        if hasattr(ds, "keys"):  # a DatasetDict
            if split not in ds:
                splits = ", ".join(repr(k) for k in ds)
                raise UserError(f"{p}: the DatasetDict has no split {split!r} (splits: {splits}); set {split_key}")
            ds = ds[split]
        elif split_key == "data.eval_split":
            raise UserError(f"{p}: a single Dataset has no splits; data.eval_split needs a DatasetDict directory")
        return ds.to_list(), list(ds.column_names)
    return _read_data_files(source, _data_files(source))


def _load_from_disk(p: Path):
    import datasets

    try:
        with quiet_datasets():
            return datasets.load_from_disk(str(p))
    except Exception as e:  # FileNotFoundError, JSON/Arrow errors from a damaged directory
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{p}: not a readable `datasets` directory ({first}); save it again with save_to_disk"
        ) from None


def _data_files(source: str) -> list[str]:
    """The data files of a directory (top level) or a glob, sorted; all of one builder's kind."""
    p = Path(source)
    found = sorted(p.iterdir()) if p.is_dir() else [Path(f) for f in sorted(glob.glob(source))]
    files = [f for f in found if f.is_file() and not f.name.startswith(".")]
    if not files:
        raise UserError(f"data source '{source}' matches no files; check data.source / data.eval_source")
    kinds = {_DATA_FILE_BUILDERS.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) > 1:
        names = ", ".join(sorted({f.suffix or f.name for f in files}))
        raise UserError(
            f"{source}: holds files of kinds {names}; a file set must be all .parquet, all .jsonl/.json, all .csv "
            "or all .arrow (or a `datasets` save_to_disk directory)"
        )
    return [str(f) for f in files]


def _read_data_files(source: str, files: list[str]) -> tuple[list[dict], list[str]]:
    """`datasets.load_dataset(<builder>, data_files=files)` with a throwaway cache: nothing is kept on disk."""
    import tempfile

    import datasets

    builder = _DATA_FILE_BUILDERS[Path(files[0]).suffix.lower()]
    with tempfile.TemporaryDirectory(prefix="forgeweave-datasets-") as cache, quiet_datasets():
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache)
        except Exception as e:  # DatasetGenerationError, ArrowInvalid, ...: a malformed file in the set
            why = " ".join(f"{type(e.__cause__ or e).__name__}: {e.__cause__ or e}".split())[:200]
            raise UserError(f"{source}: `datasets` cannot read these {builder} files ({why}); fix them") from None
        return ds.to_list(), list(ds.column_names)


@contextlib.contextmanager
def quiet_datasets():
    """No `datasets` progress bars on the console while prep reads or saves (restored afterwards)."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 text (bad byte at offset {e.start}); re-save it as UTF-8") from None


def union_keys(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _read_jsonl(p: Path) -> tuple[list[dict], list[str]]:
    rows = []
    # split on "\n" only: str.splitlines would also split on U+2028, which JSON strings may hold unescaped
    for n, line in enumerate(_read_text(p).split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = strict_json_loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}: line {n} is not valid JSON ({e.msg} at column {e.colno}); fix that line") from None
        except ValueError as e:
            raise UserError(f"{p}: line {n}: {e}; fix that line") from None
        if not isinstance(obj, dict):
            raise UserError(f"{p}: line {n} is a JSON {type(obj).__name__}, not an object; write one object per line")
        rows.append(obj)
    return rows, union_keys(rows)


def _read_json(p: Path) -> tuple[list[dict], list[str]]:
    try:
        data = strict_json_loads(_read_text(p))
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}); fix it") from None
    except ValueError as e:
        raise UserError(f"{p}: {e}; fix it") from None
    if not isinstance(data, list):
        raise UserError(f"{p}: expected a JSON list of objects, got a {type(data).__name__}; or use .jsonl")
    for i, item in enumerate(data, 1):
        if not isinstance(item, dict):
            raise UserError(f"{p}: item {i} is a JSON {type(item).__name__}, not an object; make every item an object")
    return data, union_keys(data)


def strict_json_loads(text: str) -> Any:
    """json.loads that refuses what the standard module silently accepts: a key twice in one object (the last one
    would win) and the non-standard constants NaN, Infinity, -Infinity. Raises ValueError saying which.

    >>> strict_json_loads('{"a": 1, "a": 2}')
    Traceback (most recent call last):
    ValueError: duplicate key 'a' in one object
    """

    def pairs(items: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for k, v in items:
            if k in seen:
                raise ValueError(f"duplicate key {k!r} in one object")
            seen[k] = v
        return seen

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number; write the value as a string or a finite number")

    return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)


def _read_csv(p: Path) -> tuple[list[dict], list[str]]:
    reader = csv.DictReader(io.StringIO(_read_text(p), newline=""))
    rows = []
    try:
        for row in reader:
            if None in row:  # csv puts fields beyond the header under the key None
                raise UserError(f"{p}: line {reader.line_num} has more fields than the header; quote commas in values")
            rows.append(row)
    except csv.Error as e:
        raise UserError(f"{p}: line {reader.line_num} is not valid CSV ({e}); fix it") from None
    return rows, list(reader.fieldnames or [])


def _read_parquet(p: Path) -> tuple[list[dict], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        first_line = str(e).strip().split("\n")[0]
        raise UserError(f"{p}: not a readable parquet file ({first_line}); re-export it") from None
    return table.to_pylist(), table.column_names


_READERS: dict[str, Callable[[Path], tuple[list[dict], list[str]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}
