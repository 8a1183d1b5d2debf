"""The MLflow outbox: every tracking record is written to the run directory first, then delivered in order.

`run_dir/mlflow_outbox.jsonl` is append-only: one JSON record per line, `{"seq": n, "op": ..., "ts": ms, ...}`,
seq counting up from 0. `run_dir/mlflow_state.json` (replaced atomically) says where records go and how far
delivery got: `{"uri", "experiment_id", "run_id", "sent": last delivered seq, "offset": byte offset of the
first undelivered line, "skipped": [...]}`. A record is marked sent only after the store accepted it, so a crash
between the two resends it; every operation the sender performs is idempotent (metrics carry their original
timestamp, artifacts overwrite, model versions are looked up before they are created), so a resend leaves no
duplicate. A process killed mid-append leaves a torn last line: readers skip it and the next writer cuts it
off before appending. A state recorded for another tracking URI means "nothing delivered there yet".

Only one process sends at a time: `sending_lock` is an exclusive, non-blocking `flock` on
`run_dir/mlflow_outbox.lock`. Pure file handling: no mlflow import here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import threading
import time
from pathlib import Path

from forge.io import write_json

OUTBOX = "mlflow_outbox.jsonl"
STATE = "mlflow_state.json"
LOCK = "mlflow_outbox.lock"


def now_ms() -> int:
    return int(time.time() * 1000)


class Outbox:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / OUTBOX
        self.state_path = self.run_dir / STATE
        self._lock = threading.Lock()
        self._next: int | None = None

    def append(self, op: str, **fields) -> int:
        """Write one record (flushed before returning) and return its seq."""
        with self._lock:
            if self._next is None:
                self._next = self._cut_torn_tail() + 1
            record = {"seq": self._next, "op": op, "ts": now_ms(), **fields}
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._next += 1
            return record["seq"]

    def records(self, offset: int = 0) -> list[tuple[int, dict]]:
        """(byte offset after the line, record) for each complete, valid line from `offset` on."""
        if not self.path.exists():
            return []
        out = []
        with self.path.open("rb") as f:
            f.seek(offset)
            for line in f:
                offset += len(line)
                if not line.endswith(b"\n"):
                    break  # torn last line: its writer died mid-append
                with contextlib.suppress(ValueError):
                    out.append((offset, json.loads(line)))
        return out

    def pending(self, state: dict) -> list[tuple[int, dict]]:
        """Records not delivered yet according to `state` (see `load_state`)."""
        return [(end, r) for end, r in self.records(state.get("offset", 0)) if r["seq"] > state.get("sent", -1)]

    def load_state(self, uri: str) -> dict:
        """The delivery state for `uri`; a fresh one if none was saved or it was saved for another store."""
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            state = {}
        return state if state.get("uri") == uri else fresh_state(uri)

    def save_state(self, state: dict) -> None:
        write_json(self.state_path, state)

    def max_step(self, op: str) -> int:
        """Highest `step` among records of kind `op` (-1 if none): what a resumed run has already recorded."""
        return max((r.get("step", -1) for _, r in self.records() if r.get("op") == op), default=-1)

    def _cut_torn_tail(self) -> int:
        """Truncate an incomplete last line; return the last valid seq (-1 for an empty outbox)."""
        if not self.path.exists():
            return -1
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with self.path.open("r+b") as f:
                f.truncate(end)
        records = self.records()
        return records[-1][1]["seq"] if records else -1


def fresh_state(uri: str) -> dict:
    """Nothing delivered to `uri` yet."""
    return {"uri": uri, "sent": -1, "offset": 0, "skipped": []}


@contextlib.contextmanager
def sending_lock(run_dir: Path):
    """Yield True if this process may send the run's outbox now (no other sender holds it), else False."""
    f = (Path(run_dir) / LOCK).open("a")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        f.close()
