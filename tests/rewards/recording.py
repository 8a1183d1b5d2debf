"""A verifier that records what the reward path hands it, for the label-free acceptance tests (issue 17).

`record` appends one JSON line per call to the file named by $FORGEWEAVE_TEST_RECORD: the process id, the keyword
argument names it received (besides prompts and completions) and, for every per-item argument (the data columns,
completion_ids), the set of values it held, each as text. A file, because in Ray mode the reward stage runs in an
actor, another process; the actors inherit the variable from the driver that starts the private Ray instance.
Every completion scores 0.
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "FORGEWEAVE_TEST_RECORD"
SPEC = "tests.rewards.recording:record"


def as_text(value: Any) -> str:
    """A value as the record holds it: a string as is, anything else as JSON (7 -> '7', [5, 6] -> '[5, 6]')."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def record(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    columns = {k: sorted({as_text(v) for v in values}) for k, values in kwargs.items() if isinstance(values, list)}
    line = json.dumps({"pid": os.getpid(), "keys": sorted(kwargs), "columns": columns}) + "\n"
    with open(os.environ[ENV], "a", encoding="utf-8") as f:  # one write per call: lines never interleave
        f.write(line)
    return [0.0] * len(completions)


def read_records(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
