"""Which rows train, which evaluate and which probe: the configured sources read, validated and split (nothing
is written here).

data.source 'arithmetic' generates both splits (forge.tasks.arith.generate_arithmetic); another source is split by
holding out data.eval_size valid rows at random (seeded), unless data.eval_source names a separate eval source or
data.eval_split a split of the DatasetDict, whose valid rows are all used. A labelled probe set
(`collapse.probe_source`, for the collapse guard) is read and checked like an eval source.

Unlabeled data: with `reward.label_free`, a training source without the answer column trains; its rows' answer
is None. Eval needs reference answers, so such a source needs `data.eval_source` (or `data.eval_split`) naming
labelled rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from forge.config_base import ConfigError
from forge.data.config import DataConfig
from forge.data.sources import is_dataset_dict, is_glob, load_rows, no_column_message, source_label, union_keys
from forge.data.validate import validated
from forge.errors import UserError

CountTokens = Callable[[str | list[dict]], int]
Rows = list[dict]


def split_rows(dc: DataConfig, count_tokens: CountTokens, seed: int, label_free: bool) -> tuple[Rows, Rows, Rows]:
    """(train, eval, rejected items with their "file") from the configured sources; `seed`: the run's (generation
    and the held-out draw); `label_free`: reward.label_free (a training source may lack answers)."""
    if dc.source == "arithmetic":
        train, eval_, rejected = _generated(dc, count_tokens, seed)
    else:
        train, eval_, rejected = _from_source(dc, count_tokens, seed, label_free)
    if dc.eval_source or dc.eval_split:
        eval_, eval_rejected = _separate_eval(dc, count_tokens)
        rejected = rejected + eval_rejected
    return train, eval_, rejected


def _generated(dc: DataConfig, count_tokens: CountTokens, seed: int) -> tuple[Rows, Rows, Rows]:
    """The arithmetic task's splits, validated like any source's (no eval rows when data.eval_source replaces them)."""
    if dc.eval_split:
        raise ConfigError("config key 'data.eval_split' applies to a DatasetDict source, not 'arithmetic': clear it")
    from forge.tasks.arith import generate_arithmetic  # here: the task module's checks pull in forge.rewards (torch)

    gen_train, gen_eval = generate_arithmetic(dc, seed)
    train, rejected = validated(gen_train, "arithmetic:train", "prompt", "answer", dc, count_tokens)
    if dc.eval_source:
        return train, [], rejected
    eval_, eval_rejected = validated(gen_eval, "arithmetic:eval", "prompt", "answer", dc, count_tokens)
    return train, eval_, rejected + eval_rejected


def _from_source(dc: DataConfig, count_tokens: CountTokens, seed: int, label_free: bool) -> tuple[Rows, Rows, Rows]:
    """data.source's valid rows: all train when a separate eval source or split is set, else data.eval_size of
    them are held out (seeded) for eval."""
    _check_split_key(dc.source, dc.split, "train", "data.split")
    label = source_label(dc.source, dc.split)
    rows = load_rows(dc.source, dc.prompt_column, None, dc.split)
    answers = dc.answer_column if _labelled(rows, label, dc, label_free) else None
    separate = dc.eval_source or dc.eval_split
    if not separate and answers is None:  # eval and pass@1 need reference answers
        raise UserError(
            f"{label}: no answer column '{dc.answer_column}' to hold out eval rows from; set data.eval_source "
            "to a labelled file"
        )
    good, rejected = validated(rows, label, dc.prompt_column, answers, dc, count_tokens)
    train, eval_ = (good, []) if separate else _hold_out(good, dc.eval_size, seed, label)
    return train, eval_, rejected


def _separate_eval(dc: DataConfig, count_tokens: CountTokens) -> tuple[Rows, Rows]:
    """(eval rows, rejected) of data.eval_source, or of the DatasetDict split data.eval_split."""
    source = dc.eval_source or dc.source
    split, key = (dc.eval_split, "data.eval_split") if dc.eval_split else (dc.split, "data.split")
    _check_split_key(source, dc.eval_split, "", "data.eval_split")
    label = source_label(source, split)
    rows = load_rows(source, dc.prompt_column, dc.answer_column, split, key)
    return validated(rows, label, dc.prompt_column, dc.answer_column, dc, count_tokens)


def _labelled(rows: list[dict], label: str, dc: DataConfig, label_free: bool) -> bool:
    """Whether the training rows carry reference answers (some row has data.answer_column). A source without
    them trains only with reward.label_free (the reward never reads answers then); else a UserError saying so."""
    if any(dc.answer_column in r for r in rows):
        return True
    if not label_free:
        fix = "data.answer_column or set reward.label_free=true"
        raise UserError(no_column_message(label, dc.answer_column, union_keys(rows), fix))
    return False


def _check_split_key(source: str, split: str, default: str, key: str) -> None:
    """A split name other than the default only means something for a DatasetDict directory."""
    if split != default and not is_dataset_dict(source):
        raise ConfigError(
            f"config key '{key}' is {split!r}, but '{source}' is not a `datasets` DatasetDict directory (no "
            f"dataset_dict.json): set it to {default!r} or point the source at a DatasetDict"
        )


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


def probe_rows(dc: DataConfig, source: str, count_tokens: CountTokens) -> tuple[Rows, Rows]:
    """The labelled probe rows of `source` (collapse.probe_source; none when it is empty) and the rejected ones, read
    and checked as an eval source is (data.prompt_column / data.answer_column, data.on_bad_rows)."""
    if not source:
        return [], []
    if not (Path(source).exists() or is_glob(source)):
        raise UserError(
            f"collapse.probe_source '{source}' does not exist; point it at a labelled file (prompt and answer columns, "
            "as for data.eval_source) or set it to '' for no probe"
        )
    rows = load_rows(source, dc.prompt_column, dc.answer_column, split_key="collapse.probe_source")
    return validated(rows, source, dc.prompt_column, dc.answer_column, dc, count_tokens)
