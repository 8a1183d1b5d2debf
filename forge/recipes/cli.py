"""`python -m forge.recipes.grpo`: the GRPO recipe run alone, in this process, with no Prefect and no Ray (as
nanochat's scripts run): a preset, dotted overrides, a run directory. `forgeweave run` adds the Prefect flow run,
MLflow and Ray on top of the same `run`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from forge.config import ConfigError, apply_overrides
from forge.errors import UserError
from forge.presets import PRESETS, compose
from forge.rundir import default_run_dir


def main(run: Callable[..., dict], argv: list[str] | None = None) -> None:
    """Parse the arguments, train with `run` (`forge.recipes.grpo.run`), print where the run went and its eval."""
    ap = argparse.ArgumentParser(prog="python -m forge.recipes.grpo", description=__doc__)
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS), help="a named preset (forge/presets.py)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeat it)")
    ap.add_argument("--run-dir", type=Path, help="the run directory (default: $FORGEWEAVE_RUNS_DIR or runs/, "
                    "then <preset>-<time>)")  # fmt: skip
    ap.add_argument("--resume", action="store_true", help="continue --run-dir from its last checkpoint")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        cfg = apply_overrides(compose(args.preset, None), args.set)
        run_dir = args.run_dir or default_run_dir(cfg.preset)
        summary = run(cfg, run_dir, resume=args.resume, progress=not args.no_progress)
    except (UserError, ConfigError) as e:
        sys.exit(f"forgeweave: {e}")
    first, last = summary["eval"]["initial"], summary["eval"]["final"]
    print(f"forgeweave: {summary['run_dir']}: {summary['steps']} steps, eval pass@1 {first.get('pass@1')} -> "
          f"{last.get('pass@1')}")  # fmt: skip
