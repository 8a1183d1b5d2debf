"""`SafeCalls`: the optional trackers (TensorBoard, W&B) run every call through one, so an error never reaches the
training loop: the first caught exception prints one warning line and turns that tracker off for the rest of the
run."""

from __future__ import annotations

import sys
from collections.abc import Callable


class SafeCalls:
    """Runs a tracker's calls; the first exception prints one warning line and turns the tracker off (training
    goes on: tracking must never stop it)."""

    def __init__(self, name: str):
        self.name, self.off = name, False

    def __call__(self, fn: Callable, *args) -> None:
        if self.off:
            return
        try:
            fn(*args)
        except Exception as e:
            self.off = True
            print(f"forgeweave: warning: {self.name} tracking stopped for this run: {type(e).__name__}: {e}",
                  file=sys.stderr)  # fmt: skip
