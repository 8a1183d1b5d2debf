"""Prep stage: turn the configured data source into validated train/eval splits on disk, and sample prompts.

Sources are the built-in arithmetic generator (`generate_arithmetic`), a .jsonl/.json/.csv/.parquet file, a
Hugging Face `datasets` directory written by `save_to_disk` (a Dataset, or a DatasetDict: `data.split` and
`data.eval_split` pick the splits), or a directory or glob of data files read by `datasets.load_dataset`
(`load_rows`; `datasets` is imported only for those). A prompt is a string or a list of `{"role", "content"}`
chat messages. Rows are checked one by one (`validate_rows`), given the exact text the model sees
(`model_input = format_prompt(prompt)`), and written to run_dir/data/{train,eval}.parquet plus manifest.json.
A labelled probe set (`collapse.probe_source`, for the collapse guard) is read and checked like an eval source and
written to data/probe.parquet; the manifest counts its rows and the content hash covers it.

Columns keep their types: every column is stored with the Arrow type of its values (int, float, bool, string,
list, struct), so `read_split` returns what the source held. A column whose rows hold different types (an int in
one row, a string in another) is a one-line error naming the column and two row numbers; ints and floats mixed
in one column are stored as floats. A row that lacks a column gets None there. The answer column is also
kept as `answer` (as text, what the built-in verifiers compare), and under its own name, with its own type,
when `data.answer_column` names another column.

Unlabeled data: with `reward.label_free`, a training source without the answer column trains; its rows' answer
is None (null in train.parquet, still a string column) and the manifest says `"train_labelled": false`. Eval
needs reference answers, so such a source needs `data.eval_source` (or `data.eval_split`) naming labelled rows.

Plan purely, act separately: `build` reads and validates and returns a `PreparedData` without writing;
`write_prepared` writes it; `prepare` does both. Every file is written atomically; the manifest is removed first
and written last, so a manifest always describes the parquet files beside it. Everything but the manifest's
"created" timestamp is a function of the config (seed included) and the source files.

`PromptSampler` then draws training rows in a seeded order per epoch; its state is two integers, so a resumed
run continues with exactly the batches it would have drawn.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import hashlib
import io
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from forge.config import ConfigError, DataConfig, RunConfig
from forge.errors import UserError
from forge.io import atomic_write_bytes, write_json

_OPS: dict[str, Callable[[Any, Any], Any]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_MAX_DIGITS = 9  # a 9-digit product stays below 1e18, inside int64
_ENUMERATE_LIMIT = 1 << 22  # operand pairs x ops up to which every problem is enumerated (digits <= 3)
_SAMPLE_ROUNDS = 20  # above the limit, problems are drawn at random in this many rounds at most
_BASE_COLUMNS = ["id", "prompt", "model_input", "answer"]
_ROLES = ("system", "user", "assistant")
_DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
_MAX_REJECTED_IN_MANIFEST = 100
_MAX_REJECTED_IN_ERROR = 5

Problem = tuple[int, int, int]  # (a, index into the op list, b)


@dataclass(frozen=True)
class PreparedData:
    """Output of the prep stage. Every row has the same columns: id (str), prompt (raw: a string or a list of
    messages), model_input (str: prompt after format_prompt, what the model sees), answer (str; None in unlabeled
    training rows), then every other source column with its own type (sorted; None where a row lacks one). Rows
    are as `read_split` will return them (they went through Arrow once). `manifest` is what manifest.json holds.
    `probe`: the probe rows (collapse.probe_source; empty without one), with the same base columns and its own other
    columns."""

    train: list[dict]
    eval: list[dict]
    manifest: dict
    probe: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------- built-in arithmetic task


def generate_arithmetic(cfg: DataConfig, seed: int) -> tuple[list[dict], list[dict]]:
    """Return (train_rows, eval_rows) of {"id", "prompt", "answer"} arithmetic problems, deterministic by seed.

    A problem is an ordered (a, op, b); each appears at most once, so the splits are disjoint (note that 3+5 and
    5+3 are different problems and may land in different splits). Subtractions with a < b are skipped unless
    data.allow_negative (their swap is already in the space). When fewer problems exist than
    train_size + eval_size, all are used: eval gets min(eval_size, max(1, 25% of them)), train the rest (at most
    train_size); nothing is repeated. Up to 3 digits the space is enumerated; above, problems are drawn at random
    and a filter too strict to find enough of them is a ConfigError.
    """
    ops, lo, hi = _arith_space(cfg)
    need = cfg.train_size + cfg.eval_size
    rng = np.random.default_rng(seed)
    if (hi - lo + 1) ** 2 * len(ops) <= _ENUMERATE_LIMIT:
        problems = _enumerate_problems(cfg, ops, lo, hi, need, rng)
    else:
        problems = _sample_problems(cfg, ops, lo, hi, need, rng)
    if cfg.eval_overlap:
        # the whole space trains; eval is a seeded sample of the same space (tiny tasks: mastery, not generalisation)
        rows = [_arith_row(cfg, a, ops[k], b) for a, k, b in problems[: cfg.train_size]]
        picks = rng.permutation(len(problems))[: cfg.eval_size]
        return rows, [_arith_row(cfg, *_named(problems[i], ops)) for i in picks]
    n_eval, n_train = _split_sizes(len(problems), cfg)
    rows = [_arith_row(cfg, a, ops[k], b) for a, k, b in problems[: n_eval + n_train]]
    return rows[n_eval:], rows[:n_eval]


def _named(problem: Problem, ops: list[str]) -> tuple[int, str, int]:
    a, k, b = problem
    return a, ops[k], b


def _arith_space(cfg: DataConfig) -> tuple[list[str], int, int]:
    """Check the arithmetic settings; return (distinct ops, smallest operand, largest operand)."""
    ops = list(dict.fromkeys(cfg.operations))
    _check(bool(ops) and all(o in _OPS for o in ops), "data.operations", f"must list +, - or * (got {cfg.operations})")
    _check(1 <= cfg.digits <= _MAX_DIGITS, "data.digits", f"must be between 1 and {_MAX_DIGITS}")
    _check(cfg.train_size >= 1, "data.train_size", "must be >= 1")
    _check(cfg.eval_size >= 0, "data.eval_size", "must be >= 0")
    hi = 10**cfg.digits - 1
    lo = (0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)) if cfg.min_operand == -1 else cfg.min_operand
    _check(0 <= lo <= hi, "data.min_operand", f"must be -1 or between 0 and {hi} for digits={cfg.digits}")
    try:
        cfg.prompt_template.format(a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError):
        raise ConfigError(
            f"config key 'data.prompt_template' must only use the fields {{a}} {{op}} {{b}}, got "
            f"{cfg.prompt_template!r}"
        ) from None
    return ops, lo, hi


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {why}")


def _valid_mask(cfg: DataConfig, op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: which (a op b) are kept by data.allow_negative and data.max_result."""
    keep = np.ones(a.shape, dtype=bool)
    if op == "-" and not cfg.allow_negative:
        keep &= a >= b
    if cfg.max_result >= 0:
        keep &= _OPS[op](a, b) <= cfg.max_result
    return keep


def _enumerate_problems(
    cfg: DataConfig, ops: list[str], lo: int, hi: int, need: int, rng: np.random.Generator
) -> list[Problem]:
    """Every valid problem in a fixed order, then the first `need` of a seeded permutation (all if fewer)."""
    values = np.arange(lo, hi + 1, dtype=np.int64)
    a, b = np.repeat(values, len(values)), np.tile(values, len(values))
    parts = []
    for k, op in enumerate(ops):
        keep = _valid_mask(cfg, op, a, b)
        parts.append(np.stack([a[keep], np.full(int(keep.sum()), k), b[keep]], axis=1))  # [n_op, 3]
    table = np.concatenate(parts)  # [n, 3]
    return [tuple(p) for p in table[rng.permutation(len(table))[:need]].tolist()]


def _sample_problems(
    cfg: DataConfig, ops: list[str], lo: int, hi: int, need: int, rng: np.random.Generator
) -> list[Problem]:
    """Draw random valid problems until `need` distinct ones are found (first-drawn order)."""
    found: dict[Problem, None] = {}
    size = max(1024, 2 * need)
    for _ in range(_SAMPLE_ROUNDS):
        a, b = rng.integers(lo, hi + 1, size), rng.integers(lo, hi + 1, size)
        k = rng.integers(0, len(ops), size)
        keep = np.zeros(size, dtype=bool)
        for i, op in enumerate(ops):
            keep |= (k == i) & _valid_mask(cfg, op, a, b)
        for p in zip(a[keep].tolist(), k[keep].tolist(), b[keep].tolist(), strict=True):
            found[p] = None
            if len(found) == need:
                return list(found)
    raise ConfigError(
        f"data: found only {len(found)} of {need} arithmetic problems with digits={cfg.digits} and "
        f"max_result={cfg.max_result}; raise data.max_result or lower data.train_size/eval_size"
    )


def _split_sizes(available: int, cfg: DataConfig) -> tuple[int, int]:
    """(n_eval, n_train) for `available` distinct problems (see generate_arithmetic for the small-space rule)."""
    if available >= cfg.train_size + cfg.eval_size:
        return cfg.eval_size, cfg.train_size
    n_eval = min(cfg.eval_size, max(1, available // 4))
    n_train = min(cfg.train_size, available - n_eval)
    if n_train < 1:
        raise ConfigError(
            f"data: only {available} arithmetic problems match data.digits/operations/min_operand/"
            "max_result; relax them"
        )
    return n_eval, n_train


def _arith_row(cfg: DataConfig, a: int, op: str, b: int) -> dict:
    prompt = cfg.prompt_template.format(a=a, op=op, b=b)
    return {"id": f"arith-{a}{op}{b}", "prompt": prompt, "answer": str(_OPS[op](a, b))}


# ---------------------------------------------------------------- reading files


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
    that no row has (answer_column None: the answer column is not required, see `_labelled`). Per-row problems
    are left to `validate_rows`. Blank .jsonl lines are skipped, so row N is the Nth object (for .csv, the Nth
    record after the header).
    """
    p = Path(path)
    if p.is_dir() or _is_glob(str(path)):
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
            raise UserError(_no_column(path, column, columns, key))
    return rows


def _no_column(path: str | Path, column: str, columns: list[str], fix: str) -> str:
    found = ", ".join(repr(c) for c in list(columns)[:10])
    return f"{path}: no column '{column}' in any row (found {found}); set {fix}"


def source_label(source: str, split: str | None) -> str:
    """How errors and row ids name a source: the path, plus ':split' for a DatasetDict's split."""
    return f"{source}:{split}" if split and is_dataset_dict(source) else source


def is_dataset_dict(source: str) -> bool:
    return (Path(source) / "dataset_dict.json").is_file()


def _is_glob(source: str) -> bool:
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


def _union_keys(rows: list[dict]) -> list[str]:
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
    return rows, _union_keys(rows)


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
    return data, _union_keys(data)


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


# ---------------------------------------------------------------- validating rows


def validate_rows(
    rows: list[dict],
    *,
    source: str,
    prompt_column: str,
    answer_column: str | None,
    count_tokens: Callable[[str | list[dict]], int],
    max_prompt_tokens: int,
) -> tuple[list[dict], list[int], list[dict]]:
    """Split rows into (good, their 1-based row numbers, rejected). Pure.

    rejected items are {"row": 1-based row number, "reason": ...}, reasons naming the column: "missing field
    'answer'", "prompt is not a string or a list of messages (got int)", "empty prompt", "prompt message 2 has
    role 'tool'; use system, user or assistant", "answer is not a string or number (got list)", "empty answer",
    "prompt has 300 tokens > data.max_prompt_tokens=256", "duplicate id 'x' (first at row 2)".
    count_tokens gets the raw prompt; pass a function that applies the chat template and tokenizes.
    Good rows become {"id", "prompt", "answer", **other columns as stored}: id is the row's "id" column (as
    text), else "<source stem>-<row>"; the answer is text (numbers str()-ed), and also kept as stored under
    its own name when answer_column is not "answer"; other columns named id/prompt/answer/model_input are dropped.
    answer_column None reads unlabeled rows: no answer is checked and every row's answer is None.
    """
    good, numbers, rejected, first_row_of_id = [], [], [], {}
    stem = re.sub(r"[*?\[\]]", "", Path(source.rstrip("/")).stem) or "row"
    for n, row in enumerate(rows, 1):
        reason = _row_problem(row, prompt_column, answer_column, count_tokens, max_prompt_tokens)
        row_id = _row_id(row, stem, n)
        if reason is None and row_id in first_row_of_id:
            reason = f"duplicate id {row_id!r} (first at row {first_row_of_id[row_id]})"
        if reason is not None:
            rejected.append({"row": n, "reason": reason})
            continue
        first_row_of_id[row_id] = n
        good.append(_normalise(row, row_id, prompt_column, answer_column))
        numbers.append(n)
    return good, numbers, rejected


def _row_problem(
    row: dict,
    prompt_column: str,
    answer_column: str | None,
    count_tokens: Callable[[str | list[dict]], int],
    max_prompt_tokens: int,
) -> str | None:
    """Why this row is invalid, or None. Cheap checks first; tokens are counted last."""
    for column in (prompt_column, answer_column):
        if column is not None and row.get(column) is None:
            return f"missing field '{column}'"
    prompt = row[prompt_column]
    why = _prompt_problem(prompt, prompt_column)
    if why is None and answer_column is not None:
        why = _answer_problem(row[answer_column], answer_column)
    if why is not None:
        return why
    n_tokens = count_tokens(prompt)
    if n_tokens > max_prompt_tokens:
        return f"{prompt_column} has {n_tokens} tokens > data.max_prompt_tokens={max_prompt_tokens}"
    return None


def _answer_problem(answer: Any, column: str) -> str | None:
    """Why a reference answer is not a non-empty string or finite number, or None."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"{column} is not a string or number (got {type(answer).__name__})"
    if isinstance(answer, float) and math.isinf(answer):
        return f"{column} is not a finite number (got {answer})"
    if isinstance(answer, str) and "\x00" in answer:
        return f"{column} contains a NUL byte (a binary or mis-encoded file?)"
    if not _answer_text(answer).strip():
        return f"empty {column}"
    return None


def _prompt_problem(prompt: Any, column: str) -> str | None:
    """Why a prompt is neither a non-empty string nor a list of {role, content} chat messages, or None."""
    if isinstance(prompt, str):
        if "\x00" in prompt:
            return f"{column} contains a NUL byte (a binary or mis-encoded file?)"
        return None if prompt.strip() else f"empty {column}"
    if not isinstance(prompt, list):
        return f"{column} is not a string or a list of messages (got {type(prompt).__name__})"
    if not prompt:
        return f"empty {column} (no messages)"
    for i, message in enumerate(prompt, 1):
        if not isinstance(message, dict):
            return f"{column} message {i} is not a {{role, content}} object (got {type(message).__name__})"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in _ROLES:
            return f"{column} message {i} has role {role!r}; use system, user or assistant"
        if not isinstance(content, str):
            return f"{column} message {i} content is not a string (got {type(content).__name__})"
        if "\x00" in content:
            return f"{column} message {i} contains a NUL byte (a binary or mis-encoded file?)"
    if not any(m["content"].strip() for m in prompt):
        return f"empty {column} (every message is blank)"
    return None


def _answer_text(answer: str | int | float) -> str:
    if isinstance(answer, float) and math.isnan(answer):  # a null in a pandas-written float column
        return ""
    return str(answer)


def _to_str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:  # dates and other parquet types
        return str(value)


def _row_id(row: dict, stem: str, n: int) -> str:
    given = _to_str(row.get("id"))
    return given if given.strip() else f"{stem}-{n}"


def _normalise(row: dict, row_id: str, prompt_column: str, answer_column: str | None) -> dict:
    skip = {prompt_column, answer_column, *_BASE_COLUMNS}
    extras = {str(k): v for k, v in row.items() if k not in skip}
    if answer_column is None:  # unlabeled: no reference answer
        return {"id": row_id, "prompt": row[prompt_column], "answer": None, **extras}
    if answer_column != "answer":  # verifiers written for the source (TRL's `solution`) read it by its own name
        extras[answer_column] = row[answer_column]
    return {"id": row_id, "prompt": row[prompt_column], "answer": _answer_text(row[answer_column]), **extras}


# ---------------------------------------------------------------- column types


def check_column_types(rows: list[dict], numbers: list[int], source: str) -> None:
    """Every column holds one Arrow type across the rows (ints and floats together become floats); else a
    UserError naming the column and two row numbers (`numbers[i]` is row i's number in the source). Pure."""
    for column in dict.fromkeys(k for r in rows for k in r):
        present = [(n, r[column]) for r, n in zip(rows, numbers, strict=True) if r.get(column) is not None]
        if present and _arrow_type([v for _, v in present]) is None:
            (first, a), (other, b) = present[0], _first_clash(present)
            raise UserError(
                f"{source}: column '{column}' mixes types (row {first}: {_type_label(a)}, row {other}: "
                f"{_type_label(b)}); make every row's value the same type"
            )


def _arrow_type(values: list) -> Any:
    """The Arrow type pyarrow infers for these values, or None when they do not fit one type."""
    import pyarrow as pa

    try:
        return pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError):
        return None


def _first_clash(present: list[tuple[int, Any]]) -> tuple[int, Any]:
    """The first (row, value) that cannot share a type with the first present value."""
    head = present[0][1]
    for n, v in present[1:]:
        if _arrow_type([head, v]) is None:
            return n, v
    return present[-1]  # only the set as a whole clashes (e.g. nested lists): name the last row


def _type_label(value: Any) -> str:
    if isinstance(value, list) and value:
        return f"list of {type(value[0]).__name__}"
    return type(value).__name__


# ---------------------------------------------------------------- the stage


def prepare(
    cfg: RunConfig, run_dir: Path, format_prompt: Callable[[str], str], count_tokens: Callable[[str], int]
) -> PreparedData:
    """Run the prep stage: `build` the splits, then write run_dir/data/{train,eval}.parquet and manifest.json.

    format_prompt maps a raw prompt to the text the model sees (chat template applied); count_tokens counts the
    tokens of such a text. Nothing is written when validation fails.
    """
    data = build(cfg, format_prompt, count_tokens)
    write_prepared(data, run_dir)
    return data


def build(
    cfg: RunConfig,
    format_prompt: Callable[[str | list[dict]], str],
    count_tokens: Callable[[str], int],
) -> PreparedData:
    """Generate or load, validate and split the data; writes nothing.

    data.source 'arithmetic' generates both splits; another source is split by holding out data.eval_size valid
    rows at random (seeded), unless data.eval_source names a separate eval source or data.eval_split a split of
    the DatasetDict, whose valid rows are all used. Invalid rows raise UserError (data.on_bad_rows=error) or are
    dropped and recorded in the manifest (skip). The rows returned have been through Arrow once, so they are
    exactly what `read_split` returns after `write_prepared`, and hash the same.
    """

    def count_model_tokens(prompt: str | list[dict]) -> int:
        return count_tokens(format_prompt(prompt))

    train, eval_, rejected = _splits(cfg, count_model_tokens)
    probe, probe_rejected = _probe_rows(cfg, count_model_tokens)
    columns = _BASE_COLUMNS + sorted({k for r in train + eval_ for k in r} - set(_BASE_COLUMNS))
    train, eval_ = _complete(train, columns, format_prompt), _complete(eval_, columns, format_prompt)
    _check_splits_agree(train, eval_, columns)
    train, eval_ = _arrow_table(train, columns).to_pylist(), _arrow_table(eval_, columns).to_pylist()
    if probe:
        probe_columns = _BASE_COLUMNS + sorted({k for r in probe for k in r} - set(_BASE_COLUMNS))
        probe = _arrow_table(_complete(probe, probe_columns, format_prompt), probe_columns).to_pylist()
    manifest = _manifest(cfg, train, eval_, rejected + probe_rejected, columns, probe)
    return PreparedData(train, eval_, manifest, probe)


def _probe_rows(cfg: RunConfig, count_tokens: Callable[[str | list[dict]], int]) -> tuple[list[dict], list[dict]]:
    """The labelled probe rows of collapse.probe_source (none when it is empty) and the rejected ones, read and checked
    as an eval source is (data.prompt_column / data.answer_column, data.on_bad_rows)."""
    source, dc = cfg.collapse.probe_source, cfg.data
    if not source:
        return [], []
    if not (Path(source).exists() or _is_glob(source)):
        raise UserError(
            f"collapse.probe_source '{source}' does not exist; point it at a labelled file (prompt and answer columns, "
            "as for data.eval_source) or set it to '' for no probe"
        )
    rows = load_rows(source, dc.prompt_column, dc.answer_column, split_key="collapse.probe_source")
    return _validated(rows, source, dc.prompt_column, dc.answer_column, dc, count_tokens)


def _splits(
    cfg: RunConfig, count_tokens: Callable[[str | list[dict]], int]
) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, eval, rejected items with their "file") from the configured sources."""
    dc = cfg.data
    if dc.source == "arithmetic":
        _check(not dc.eval_split, "data.eval_split", "applies to a DatasetDict source, not 'arithmetic': clear it")
        gen_train, gen_eval = generate_arithmetic(dc, cfg.seed)
        train, rejected = _validated(gen_train, "arithmetic:train", "prompt", "answer", dc, count_tokens)
        eval_, eval_rejected = [], []
        if not dc.eval_source:
            eval_, eval_rejected = _validated(gen_eval, "arithmetic:eval", "prompt", "answer", dc, count_tokens)
    else:
        _check_split_key(dc.source, dc.split, "train", "data.split")
        label = source_label(dc.source, dc.split)
        rows = load_rows(dc.source, dc.prompt_column, None, dc.split)
        answers = dc.answer_column if _labelled(rows, label, dc, cfg.reward.label_free) else None
        separate = dc.eval_source or dc.eval_split
        if not separate and answers is None:  # eval and pass@1 need reference answers
            raise UserError(
                f"{label}: no answer column '{dc.answer_column}' to hold out eval rows from; set data.eval_source "
                "to a labelled file"
            )
        good, rejected = _validated(rows, label, dc.prompt_column, answers, dc, count_tokens)
        train, eval_ = (good, []) if separate else _hold_out(good, dc.eval_size, cfg.seed, label)
        eval_rejected = []
    if dc.eval_source or dc.eval_split:
        source = dc.eval_source or dc.source
        split, key = (dc.eval_split, "data.eval_split") if dc.eval_split else (dc.split, "data.split")
        _check_split_key(source, dc.eval_split, "", "data.eval_split")
        label = source_label(source, split)
        rows = load_rows(source, dc.prompt_column, dc.answer_column, split, key)
        eval_, eval_rejected = _validated(rows, label, dc.prompt_column, dc.answer_column, dc, count_tokens)
    return train, eval_, rejected + eval_rejected


def _labelled(rows: list[dict], label: str, dc: DataConfig, label_free: bool) -> bool:
    """Whether the training rows carry reference answers (some row has data.answer_column). A source without
    them trains only with reward.label_free (the reward never reads answers then); else a UserError saying so."""
    if any(dc.answer_column in r for r in rows):
        return True
    if not label_free:
        fix = "data.answer_column or set reward.label_free=true"
        raise UserError(_no_column(label, dc.answer_column, _union_keys(rows), fix))
    return False


def _check_split_key(source: str, split: str, default: str, key: str) -> None:
    """A split name other than the default only means something for a DatasetDict directory."""
    if split != default and not is_dataset_dict(source):
        raise ConfigError(
            f"config key '{key}' is {split!r}, but '{source}' is not a `datasets` DatasetDict directory (no "
            f"dataset_dict.json): set it to {default!r} or point the source at a DatasetDict"
        )


def _validated(
    rows: list[dict],
    source: str,
    prompt_column: str,
    answer_column: str | None,
    dc: DataConfig,
    count_tokens: Callable[[str | list[dict]], int],
) -> tuple[list[dict], list[dict]]:
    """validate_rows (answer_column None: unlabeled rows) plus the data.on_bad_rows policy and the
    one-type-per-column check; rejected items get a "file" key."""
    good, numbers, rejected = validate_rows(
        rows,
        source=source,
        prompt_column=prompt_column,
        answer_column=answer_column,
        count_tokens=count_tokens,
        max_prompt_tokens=dc.max_prompt_tokens,
    )
    if rejected and (dc.on_bad_rows == "error" or not good):
        raise UserError(_bad_rows_message(source, rejected, all_bad=not good))
    check_column_types(good, numbers, source)
    return good, [{"file": source, **r} for r in rejected]


def _bad_rows_message(source: str, rejected: list[dict], all_bad: bool) -> str:
    shown = "; ".join(f"row {r['row']}: {r['reason']}" for r in rejected[:_MAX_REJECTED_IN_ERROR])
    more = "; ..." if len(rejected) > _MAX_REJECTED_IN_ERROR else ""
    noun = "row" if len(rejected) == 1 else "rows"
    fix = "fix them" if all_bad else "fix them or set data.on_bad_rows=skip"
    every = "all " if all_bad else ""
    return f"{source}: {every}{len(rejected)} invalid {noun} ({shown}{more}); {fix}"


def _hold_out(rows: list[dict], n_eval: int, seed: int, source: str) -> tuple[list[dict], list[dict]]:
    """(train, eval): n_eval rows picked by a seeded permutation go to eval; both keep the file's order."""
    if n_eval >= len(rows):
        raise UserError(
            f"{source}: {len(rows)} valid rows leave none for training after holding out "
            f"data.eval_size={n_eval}; lower data.eval_size or set data.eval_source"
        )
    is_eval = np.zeros(len(rows), dtype=bool)
    is_eval[np.random.default_rng(seed).permutation(len(rows))[:n_eval]] = True
    train = [r for r, e in zip(rows, is_eval, strict=True) if not e]
    return train, [r for r, e in zip(rows, is_eval, strict=True) if e]


def _complete(rows: list[dict], columns: list[str], format_prompt: Callable[[str | list[dict]], str]) -> list[dict]:
    """Add model_input and give every row every column (None where it had none), in column order."""
    return [{c: format_prompt(r["prompt"]) if c == "model_input" else r.get(c) for c in columns} for r in rows]


def _check_splits_agree(train: list[dict], eval_: list[dict], columns: list[str]) -> None:
    """A column has one type in both splits (they may come from different sources)."""
    for c in columns:
        a = next((r[c] for r in train if r[c] is not None), None)
        b = next((r[c] for r in eval_ if r[c] is not None), None)
        if a is not None and b is not None and _arrow_type([a, b]) is None:
            raise UserError(
                f"data: column '{c}' is {_type_label(a)} in the training rows but {_type_label(b)} in the eval "
                "rows (data.source vs data.eval_source / data.eval_split); make them one type"
            )


def _arrow_table(rows: list[dict], columns: list[str]):
    """The rows as an Arrow table, each column typed from its values (checked to fit one type before); `answer`
    is always text, also where every row's is None (unlabeled training rows)."""
    import pyarrow as pa

    def array(c: str):
        return pa.array([r[c] for r in rows], type=pa.string() if c == "answer" else None)

    return pa.table({c: array(c) for c in columns})


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


def _prompt_key(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def _manifest(
    cfg: RunConfig, train: list[dict], eval_: list[dict], rejected: list[dict], columns: list[str], probe: list[dict]
) -> dict:
    train_prompts = {_prompt_key(r["prompt"]) for r in train}
    probe_keys = {"probe_source": cfg.collapse.probe_source, "probe_rows": len(probe)} if probe else {}
    return {
        "source": cfg.data.source,
        "eval_source": cfg.data.eval_source,
        "split": cfg.data.split,
        "eval_split": cfg.data.eval_split,
        "seed": cfg.seed,
        "train_rows": len(train),
        "eval_rows": len(eval_),
        "train_labelled": any(r["answer"] is not None for r in train),  # false: an unlabeled source (label_free)
        "eval_prompts_in_train": sum(_prompt_key(r["prompt"]) in train_prompts for r in eval_),  # contamination
        "rejected_count": len(rejected),
        "rejected": rejected[:_MAX_REJECTED_IN_MANIFEST],
        "content_hash": content_hash(train, eval_, probe),
        "columns": columns,
        "column_types": {f.name: str(f.type) for f in _arrow_table(train + eval_, columns).schema},
        **probe_keys,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_prepared(data: PreparedData, run_dir: Path) -> None:
    """Write the splits as typed parquet and then the manifest, each atomically, under run_dir/data."""
    out = Path(run_dir) / "data"
    (out / "manifest.json").unlink(missing_ok=True)  # no stale manifest beside half-replaced splits
    for split, rows in (("train", data.train), ("eval", data.eval)):
        atomic_write_bytes(out / f"{split}.parquet", _parquet_bytes(rows, data.manifest["columns"]))
    if data.probe:
        atomic_write_bytes(out / "probe.parquet", _parquet_bytes(data.probe, list(data.probe[0])))
    else:
        (out / "probe.parquet").unlink(missing_ok=True)
    write_json(out / "manifest.json", data.manifest)


def _parquet_bytes(rows: list[dict], columns: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(_arrow_table(rows, columns), sink)
    return sink.getvalue().to_pybytes()


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


# ---------------------------------------------------------------- sampling prompts


class PromptSampler:
    """Endless deterministic sampler: epoch e visits the rows in the permutation seeded by (seed, e).

    The state is (epoch, cursor) plus the seed and row count it applies to, so `load_state_dict` restores exactly
    the future sequence without replaying the past.
    """

    def __init__(self, rows: list[dict], seed: int) -> None:
        if not rows:
            raise ValueError("PromptSampler needs at least one row")
        self._rows = list(rows)
        self._seed = seed
        self._epoch = 0
        self._cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._rows))

    def next_batch(self, n: int) -> list[dict]:
        """The next n rows (copies), crossing epoch boundaries; a batch can repeat a row only if n > len(rows)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch = []
        while len(batch) < n:
            if self._cursor == len(self._rows):
                self._epoch, self._cursor = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            take = min(n - len(batch), len(self._rows) - self._cursor)
            batch += [dict(self._rows[i]) for i in self._order[self._cursor : self._cursor + take]]
            self._cursor += take
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self._seed, "num_rows": len(self._rows)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict; raises UserError if it was saved for a different number of rows."""
        saved_rows = state.get("num_rows", len(self._rows))
        if saved_rows != len(self._rows):
            raise UserError(
                f"sampler state is for {saved_rows} training rows but the data has {len(self._rows)}; "
                "resume with the run's own data/train.parquet"
            )
        self._seed, self._epoch, self._cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self._epoch)
