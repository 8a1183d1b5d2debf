"""Which config and run directory a request means: a preset and/or a YAML overlay plus overrides, or an existing run."""

from __future__ import annotations

import time
from pathlib import Path

from forge.errors import UserError


def resolve_config(preset: str | None, config: str | None, overrides: list[str]):
    """The validated config of preset < YAML overlay < `--set` overrides (see `forge.presets.compose`)."""
    from forge.config import apply_overrides
    from forge.presets import compose
    from forge.rewards.registry import check_callables

    cfg = apply_overrides(compose(preset, config), overrides).validate()
    check_callables(cfg.reward)  # a config.yaml of a forge.train run whose functions cannot be imported here
    return cfg


def resolve_run(
    preset: str | None, config: str | None, overrides: list[str], name: str | None, runs_dir: str, resume: bool
):
    """(config, run directory) for a new run or, with resume, for an existing one (its saved config + overrides;
    the recipe checks and records what they change: `forge.compose.resume_changes`)."""
    from forge.config import apply_overrides, load_yaml
    from forge.rundir import check_run_dir, check_run_name

    if resume:
        if not name:
            raise UserError("--resume needs --name RUN (the run directory to continue)")
        if preset or config:
            raise UserError(
                "--resume continues the run's own config.yaml: drop --preset/--config (change keys with --set)"
            )
        run_dir = Path(runs_dir) / check_run_name(name)
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"cannot resume '{run_dir}': no such run (config.yaml missing)")
        from forge.rewards.registry import check_callables

        cfg = apply_overrides(load_yaml(run_dir / "config.yaml"), overrides).validate()
        check_callables(cfg.reward, resume=True)  # started by forge.train with functions not importable here
        return cfg, run_dir
    cfg = resolve_config(preset, config, overrides)
    name = check_run_name(name) if name else f"{cfg.preset or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_run_dir(Path(runs_dir) / name, resume=False)  # a taken name: one line before any flow run starts
    return cfg, Path(runs_dir) / name
