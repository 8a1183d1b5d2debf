"""The unlabeled arithmetic task of the `smollm2-arith-unlabeled` preset: 2-digit additions in shipped files.

- forge/tasks/arith_unlabeled_train.jsonl: 2000 prompts and ids, no answer column (what a user without reference
  answers has);
- forge/tasks/arith_eval.jsonl: 200 held-out problems with answers, for measurement only (eval pass@1);
- forge/tasks/arith_probe.jsonl: 50 other held-out problems with answers, the collapse guard's probe
  (`collapse.probe_source`); never read by the reward.

The problems are the built-in generator's (forge.data.generate_arithmetic, seed 0, prompts as in `smollm2-arith`):
the three files are disjoint. `python -m forge.arith_tasks` rewrites them; a test checks they match.
"""

from __future__ import annotations

import json
from pathlib import Path

from forge.config import DataConfig
from forge.io import atomic_write_bytes

TASKS_DIR = Path(__file__).with_name("tasks")
TRAIN_FILE = TASKS_DIR / "arith_unlabeled_train.jsonl"
EVAL_FILE = TASKS_DIR / "arith_eval.jsonl"
PROBE_FILE = TASKS_DIR / "arith_probe.jsonl"
TRAIN_SIZE, EVAL_SIZE, PROBE_SIZE = 2000, 200, 50


def generate() -> tuple[list[dict], list[dict], list[dict]]:
    """(train rows without answers, eval rows, probe rows): disjoint 2-digit additions."""
    from forge.data import generate_arithmetic

    dc = DataConfig(digits=2, operations=["+"], train_size=TRAIN_SIZE, eval_size=EVAL_SIZE + PROBE_SIZE)
    train, held_out = generate_arithmetic(dc, seed=0)
    unlabeled = [{"id": r["id"], "prompt": r["prompt"]} for r in train]
    return unlabeled, held_out[:EVAL_SIZE], held_out[EVAL_SIZE:]


def to_jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def write_task_files() -> None:
    for path, rows in zip((TRAIN_FILE, EVAL_FILE, PROBE_FILE), generate(), strict=True):
        atomic_write_bytes(path, to_jsonl(rows))


if __name__ == "__main__":
    write_task_files()
