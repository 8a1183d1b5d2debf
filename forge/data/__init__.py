"""Prep stage: turn the configured data source into validated train/eval splits on disk, and sample prompts.

Sources are the built-in arithmetic task (forge.tasks.arith), a .jsonl/.json/.csv/.parquet file, a Hugging Face
`datasets` directory written by `save_to_disk`, or a directory or glob of data files. A prompt is a string or a list
of `{"role", "content"}` chat messages. One module per concern, pure ones first:

- `sources`: read a source into rows (`load_rows`, `strict_json_loads`, `quiet_datasets`);
- `validate`: check rows and column types, apply data.on_bad_rows (`validate_rows`, `check_column_types`);
- `splits`: which rows train, evaluate and probe (generated, held out, or separate sources);
- `prepare`: the stage: `build` (pure: splits, model_input, typed columns, manifest) and `write_prepared`
  (run_dir/data/{train,eval,probe}.parquet and manifest.json, atomically); `prepare` does both;
- `store`: read a prepared run's data back and check its content hash (`read_split`, `check_data_hash`, ...);
- `sampler`: `prompt_batch`, the seeded per-epoch order training rows are drawn in (row i from (seed, i)).

The names below are re-exported here: `from forge.data import prepare, read_split, prompt_batch` is the way in.
"""

from __future__ import annotations

from typing import Any

from forge.data.prepare import DataSources, PreparedData, build, prepare, write_prepared
from forge.data.sampler import next_row, prompt_batch, sampler_state
from forge.data.sources import is_dataset_dict, load_rows, quiet_datasets, source_label, strict_json_loads
from forge.data.store import check_data_hash, content_hash, read_probe, read_split, train_row_count
from forge.data.validate import check_column_types, validate_rows

__all__ = [
    "DataSources",
    "PreparedData",
    "next_row",
    "prompt_batch",
    "sampler_state",
    "build",
    "check_column_types",
    "check_data_hash",
    "content_hash",
    "is_dataset_dict",
    "load_rows",
    "prepare",
    "quiet_datasets",
    "read_probe",
    "read_split",
    "source_label",
    "strict_json_loads",
    "train_row_count",
    "validate_rows",
    "write_prepared",
]


def __getattr__(name: str) -> Any:
    """`forge.data.generate_arithmetic` (its old home) still works; it lives in forge.tasks.arith, imported only
    when asked for, since that module's checks pull in forge.rewards (and torch)."""
    if name == "generate_arithmetic":
        from forge.tasks.arith import generate_arithmetic

        return generate_arithmetic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
