"""`data`: the prompt data's section (forge/data/prepare.py and splits.py read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge.config_base import ranged


@dataclass(kw_only=True)
class DataConfig:
    source: str = "arithmetic"
    """'arithmetic' (built-in generator), a .jsonl/.json/.csv/.parquet file, a `datasets` save_to_disk directory,
    or a directory / glob of data files read with `datasets.load_dataset` (docs/data.md)."""
    eval_source: str = ""
    """Optional separate eval file; empty = split eval_size rows off the training source."""
    train_size: int = ranged(2000, ">= 1")
    """Arithmetic: problems to generate for training."""
    eval_size: int = ranged(200, ">= 1", "(an empty eval split cannot be evaluated)")
    """Rows held out for evaluation (disjoint from training)."""
    digits: int = ranged(2, "in [1, 18]")
    """Arithmetic: digits per operand."""
    operations: list[str] = field(default_factory=lambda: ["+"])
    """Arithmetic: operators to draw from (+, -, *)."""
    min_operand: int = ranged(-1, ">= -1", "(-1 = the smallest number with `digits` digits)")
    """Arithmetic: smallest operand; -1 = the smallest number with `digits` digits (0 for one digit)."""
    max_result: int = ranged(-1, ">= -1", "(-1 = no limit)")
    """Arithmetic: keep only problems whose answer is <= this (-1 = no limit)."""
    eval_overlap: bool = False
    """Arithmetic: eval is a sample of the whole problem space, which may overlap train (for tiny spaces where
    the point is mastering the task, not generalising); the manifest counts the overlap."""
    allow_negative: bool = False
    """Arithmetic: allow negative answers (subtraction)."""
    prompt_template: str = "Compute {a} {op} {b}. Reply with only the final integer."
    """Arithmetic: prompt text; fields {a} {op} {b}."""
    prompt_column: str = "prompt"
    """File source: column holding the prompt."""
    answer_column: str = "answer"
    """File source: column holding the reference answer."""
    on_bad_rows: Literal["error", "skip"] = "error"
    """Invalid rows stop prep ('error') or are skipped and counted in the manifest ('skip')."""
    max_prompt_tokens: int = ranged(256, ">= 1")
    """Prompts longer than this (after the chat template) are invalid rows."""
    split: str = "train"
    """`datasets` DatasetDict source: the split to train on."""
    eval_split: str = ""
    """`datasets` DatasetDict source: the split to evaluate on (empty = hold out eval_size training rows)."""
