"""TensorBoard as an optional tracker: event files in <run_dir>/tensorboard/, written offline (`tracking.tensorboard`).

`TensorBoardTracker` implements `forge.tracking.Tracker` with torch's `SummaryWriter` (which needs the tensorboard
package; both are imported only when the first metrics arrive). Each metric is a scalar under its own name
(`reward/mean`, `eval/pass@1`, `train/lr`, ...) at its step; the params (the config) and the tags are one text
summary each. The writer opens at the first metrics the process logs, with `purge_step` = that step: a resumed run
(or one restarted from step 0) makes TensorBoard drop what the stopped process had logged from there on, so redone
steps are not shown twice. Artifacts, sample tables and checkpoints are not sent (they stay in the run directory and
MLflow). Events are flushed every `flush_secs` and at the end; an error turns the tracker off with one warning
(`flows.tracking.safe_calls.SafeCalls`), it never reaches the training loop.
"""

from __future__ import annotations

from pathlib import Path

from flows.tracking.safe_calls import SafeCalls
from forge.tracking import NullTracker


class TensorBoardTracker(NullTracker):
    def __init__(self, log_dir: Path, flush_secs: int = 10):
        self.log_dir, self.flush_secs = Path(log_dir), flush_secs
        self.writer = None  # torch.utils.tensorboard.SummaryWriter, from the first metrics on
        self.first_step = 0
        self.pending: list[tuple[str, str]] = []  # (tag, markdown) texts sent before the writer opened
        self.safe = SafeCalls("TensorBoard")

    def log_params(self, params: dict) -> None:
        self.safe(self._text, "config", markdown_table(params))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.safe(self._text, "tags", markdown_table(tags))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.safe(self._scalars, metrics, step)

    def info(self) -> dict:
        return {"tensorboard_dir": str(self.log_dir)}

    def finish(self, status: str) -> None:
        self.safe(self._close)

    def _text(self, tag: str, text: str) -> None:
        if self.writer is None:
            self.pending.append((tag, text))
        else:
            self.writer.add_text(tag, text, self.first_step)

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            self._open(step)
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, float(value), step)

    def _open(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=step, flush_secs=self.flush_secs)
        self.first_step = step
        for tag, text in self.pending:
            self.writer.add_text(tag, text, step)
        self.pending = []

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def markdown_table(values: dict) -> str:
    """`| key | value |` rows for a TensorBoard text summary (which renders markdown).

    >>> print(markdown_table({"update.lr": 0.001, "eval.k": 4}))
    | key | value |
    |---|---|
    | update.lr | 0.001 |
    | eval.k | 4 |
    """
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "\n".join(["| key | value |", "|---|---|", *(f"| {cell(k)} | {cell(v)} |" for k, v in values.items())])
