"""Built-in tasks, one module per task: its generator, its task-specific checks and its shipped files.

- `forge.tasks.arith`: "a op b" integer arithmetic. The generator behind `data.source=arithmetic`
  (`generate_arithmetic`), the label-free structure checks (`parity_check`, `residue3_check`, `residue5_check`,
  `magnitude_check`) and the unlabeled task's files (arith_unlabeled_train/eval/probe.jsonl).
- `forge.tasks.code`: complete a one-line Python function; the files code_{fn,op}_{train,eval}.jsonl, scored by the
  `code_exec` sandbox (forge/rewards/code_exec.py).

The shipped .jsonl files live in this directory (package data). Each task module rewrites its own with
`python -m forge.tasks.<task>`; tests check the files match the generators.
"""

from __future__ import annotations

import json
from pathlib import Path

TASKS_DIR = Path(__file__).parent
"""Where the shipped task files are (forge/tasks/)."""


def to_jsonl(rows: list[dict]) -> bytes:
    """Rows as JSON lines, keys sorted: the byte-exact form of the shipped files.

    >>> to_jsonl([{"prompt": "1 + 2", "id": "a"}])
    b'{"id": "a", "prompt": "1 + 2"}\\n'
    """
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
