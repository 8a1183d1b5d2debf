"""`python -m forge.recipes.grpo`: the recipe alone (no Prefect, no Ray) trains exactly as `forgeweave run` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flows.cli import main
from forge.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
SETS = ["steps=4", "eval.every=2", "checkpoint.every=2", "seed=1", "tracking.mlflow=false"]


def learned(run: Path) -> list[dict]:
    """Each step's metrics without the timings (those differ between any two runs)."""
    keep = lambda k: not k.startswith(("time/", "perf/")) and k not in ("timestamp", "checkpoint/bytes")  # noqa: E731
    return [{k: v for k, v in row.items() if keep(k)} for row in read_metrics(run / "metrics.jsonl")]


def test_module_entry_point_trains_as_the_cli_does(runs_dir, tmp_path):
    sets = [a for s in SETS for a in ("--set", s)]
    assert main(["run", "--preset", "tiny", "--name", "cli", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect",
                 *sets]) == 0  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "forge.recipes.grpo", "--preset", "tiny", "--run-dir",
                          str(tmp_path / "alone"), "--no-progress", *sets], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "alone" / "summary.json").read_text())
    assert out.stdout.strip().endswith(f"eval pass@1 {summary['eval']['initial']['pass@1']} -> "
                                       f"{summary['eval']['final']['pass@1']}")  # fmt: skip
    assert learned(tmp_path / "alone") == learned(runs_dir / "cli") and len(learned(runs_dir / "cli")) == 5
    weights = [(d / "checkpoints" / "step-000004" / "model.safetensors").read_bytes()
               for d in (tmp_path / "alone", runs_dir / "cli")]  # fmt: skip
    assert weights[0] == weights[1]


def test_module_entry_point_says_what_is_wrong_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "forge.recipes.grpo", "--set", "nope.key=1", "--run-dir",
                          str(tmp_path / "r")], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1 and out.stderr.startswith("forgeweave: ") and len(out.stderr.strip().splitlines()) == 1
    assert "nope" in out.stderr and "Traceback" not in out.stderr
