"""The prep stage: `build` the train/eval splits (and probe rows) from the config without writing, then
`write_prepared` them under run_dir/data; `prepare` does both.

Every row gets the exact text the model sees (`model_input = format_prompt(prompt)`) and every column (None where a
row lacks one). Columns keep their types: every column is stored with the Arrow type of its values (int, float,
bool, string, list, struct), so `read_split` returns what the source held; `answer` is a string column, null in
unlabeled training rows (the manifest then says `"train_labelled": false`).

Plan purely, act separately: `build` reads and validates and returns a `PreparedData`; `write_prepared` writes
data/{train,eval}.parquet, data/probe.parquet (with a probe set) and data/manifest.json. Every file is written
atomically; the manifest is removed first and written last, so a manifest always describes the parquet files beside
it. Everything but the manifest's "created" timestamp is a function of the config (seed included) and the source
files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from forge.data.config import DataConfig
from forge.data.splits import probe_rows, split_rows
from forge.data.store import content_hash
from forge.data.validate import BASE_COLUMNS, arrow_type, type_label
from forge.errors import UserError
from forge.io import atomic_write_bytes, write_json

_MAX_REJECTED_IN_MANIFEST = 100


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


@dataclass(frozen=True)
class DataSources:
    """What the prep stage reads: the `data` section and the values of other sections it needs."""

    data: DataConfig
    seed: int = 0
    """The run's seed: arithmetic generation and the held-out draw."""
    label_free: bool = False
    """reward.label_free: a training source may lack the answer column."""
    probe_source: str = ""
    """collapse.probe_source: the labelled probe set ('' = none)."""


def prepare(
    src: DataSources, run_dir: Path, format_prompt: Callable[[str], str], count_tokens: Callable[[str], int]
) -> PreparedData:
    """Run the prep stage: `build` the splits, then write run_dir/data/{train,eval}.parquet and manifest.json.

    format_prompt maps a raw prompt to the text the model sees (chat template applied); count_tokens counts the
    tokens of such a text. Nothing is written when validation fails.
    """
    data = build(src, format_prompt, count_tokens)
    write_prepared(data, run_dir)
    return data


def build(
    src: DataSources,
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

    train, eval_, rejected = split_rows(src.data, count_model_tokens, src.seed, src.label_free)
    probe, probe_rejected = probe_rows(src.data, src.probe_source, count_model_tokens)
    columns = BASE_COLUMNS + sorted({k for r in train + eval_ for k in r} - set(BASE_COLUMNS))
    train, eval_ = _complete(train, columns, format_prompt), _complete(eval_, columns, format_prompt)
    _check_splits_agree(train, eval_, columns)
    train, eval_ = _arrow_table(train, columns).to_pylist(), _arrow_table(eval_, columns).to_pylist()
    if probe:
        probe_columns = BASE_COLUMNS + sorted({k for r in probe for k in r} - set(BASE_COLUMNS))
        probe = _arrow_table(_complete(probe, probe_columns, format_prompt), probe_columns).to_pylist()
    manifest = _manifest(src, train, eval_, rejected + probe_rejected, columns, probe)
    return PreparedData(train, eval_, manifest, probe)


def _complete(rows: list[dict], columns: list[str], format_prompt: Callable[[str | list[dict]], str]) -> list[dict]:
    """Add model_input and give every row every column (None where it had none), in column order."""
    return [{c: format_prompt(r["prompt"]) if c == "model_input" else r.get(c) for c in columns} for r in rows]


def _check_splits_agree(train: list[dict], eval_: list[dict], columns: list[str]) -> None:
    """A column has one type in both splits (they may come from different sources)."""
    for c in columns:
        a = next((r[c] for r in train if r[c] is not None), None)
        b = next((r[c] for r in eval_ if r[c] is not None), None)
        if a is not None and b is not None and arrow_type([a, b]) is None:
            raise UserError(
                f"data: column '{c}' is {type_label(a)} in the training rows but {type_label(b)} in the eval "
                "rows (data.source vs data.eval_source / data.eval_split); make them one type"
            )


def _arrow_table(rows: list[dict], columns: list[str]):
    """The rows as an Arrow table, each column typed from its values (checked to fit one type before); `answer`
    is always text, also where every row's is None (unlabeled training rows)."""
    import pyarrow as pa

    def array(c: str):
        return pa.array([r[c] for r in rows], type=pa.string() if c == "answer" else None)

    return pa.table({c: array(c) for c in columns})


def _prompt_key(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def _manifest(
    src: DataSources, train: list[dict], eval_: list[dict], rejected: list[dict], columns: list[str], probe: list[dict]
) -> dict:
    train_prompts = {_prompt_key(r["prompt"]) for r in train}
    probe_keys = {"probe_source": src.probe_source, "probe_rows": len(probe)} if probe else {}
    return {
        "source": src.data.source,
        "eval_source": src.data.eval_source,
        "split": src.data.split,
        "eval_split": src.data.eval_split,
        "seed": src.seed,
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
