"""`forge.train`: the GRPO recipe from Python (a notebook, a script), with data and reward functions as objects.

It runs the same recipe as `forgeweave run --no-prefect` (`forge.recipes.grpo.run`, stages in this process) and
returns the same summary. What it adds is the hand-over of Python objects:

- `dataset` / `eval_dataset`: a `datasets.Dataset` (or DatasetDict, or a list of dicts) is saved with
  `save_to_disk` under `<run>/inputs/{train,eval}` before the run starts, and `data.source` / `data.eval_source`
  point there, so the data goes through exactly the validation a file source gets and config.yaml says where the
  run's data came from.
- `reward_funcs`: callables with TRL's reward-function signature (and/or verifier names) replace
  `reward.verifiers`. A callable is recorded as 'module:qualname' in `reward.verifiers` and `reward.callables`
  and resolved to the object given (`forge.rewards.registry.provided`). Callables cannot go in YAML, so a CLI
  `--resume` of such a run works only when those names can be imported; otherwise it says to resume through
  `forge.train(..., resume=True)` with the same functions.
- `environment_factory` / `tools`: a TRL-style environment class and stateless tool functions make every rollout a
  multi-turn episode (`forge.env`); recorded as 'module:qualname' in `env.environment_factory` / `env.tools` and
  resolved to the objects given, like reward callables.
- `tracker`: forge itself writes only metrics.jsonl (and the rest of the run directory); `tracking.*` (MLflow,
  TensorBoard, W&B) is applied by whoever builds the trackers, and forge imports no tracking package. Pass
  `tracker=flows.tracking.trackers_for_run` to record to what `tracking.*` turns on, exactly as `forgeweave run`
  does: a callable `(cfg, run_dir) -> Tracker | None` is called with the run's final config and directory (after
  preset, overrides and resume), so MLflow tracking (on by default) works with a preset and overrides too. A
  `forge.tracking.Tracker` object is used as given. Without `tracker`, only metrics.jsonl is written.

Stages run in this process only: configs that need several processes (vLLM, rollout replicas, several update
ranks, asynchronous GRPO) are refused; use the CLI for those.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forge.config import ConfigError, RunConfig, apply_overrides, load_yaml, overlay
from forge.errors import UserError
from forge.rundir import INPUTS, claim_run_dir, default_run_dir
from forge.tracking import Tracker

TrackerFactory = Callable[[RunConfig, Path], Tracker | None]


def train(
    config: RunConfig | dict | None = None,
    *,
    dataset: Any = None,
    eval_dataset: Any = None,
    reward_funcs: Sequence[Callable | str] | None = None,
    run_dir: str | Path | None = None,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    resume: bool = False,
    tracker: Tracker | TrackerFactory | None = None,
    environment_factory: Callable | None = None,
    tools: Sequence[Callable] | None = None,
    **kw: Any,
) -> dict:
    """Train with GRPO and return summary.json's content.

    config: a RunConfig, a (partial, nested) dict laid over `preset` (or over the defaults when no preset is
    given), or None for `preset` (default "tiny"). overrides: `section.field=value` strings applied last.
    run_dir: the run directory (default `$FORGEWEAVE_RUNS_DIR` or ./runs, then `<preset>-<time>`). resume:
    continue run_dir from its last checkpoint with its own config.yaml (plus overrides) and data; pass the same
    reward_funcs again. tracker: a Tracker, or a factory `(cfg, run_dir)` such as `flows.tracking.trackers_for_run`
    (None: metrics.jsonl only). environment_factory / tools: multi-turn episodes as TRL's GRPOTrainer takes them (a
    TRL-style environment class, stateless tool functions), recorded as 'module:qualname' in env.*
    (docs/environments.md).
    Other keyword arguments go to `forge.recipes.grpo.run` (e.g. `progress=False`).
    Raises UserError for anything a user can fix.
    """
    from forge.recipes.grpo import run
    from forge.rewards.registry import check_callables, provided

    specs, functions = _reward_specs(reward_funcs)
    env_specs = _env_specs(environment_factory, tools, functions)
    if resume:
        cfg, run_dir = _resumed(run_dir, config, dataset, eval_dataset, overrides, specs)
    else:
        cfg = apply_overrides(_base_config(config, preset), list(overrides))
        if reward_funcs is not None:
            cfg.reward.verifiers, cfg.reward.callables = specs, [k for k in functions if k in specs]
        if environment_factory is not None:
            cfg.env.environment_factory = env_specs[0]
        if tools is not None:
            cfg.env.tools = env_specs[1:]
        run_dir = Path(run_dir) if run_dir else default_run_dir(cfg.preset)
    cfg.validate()
    _check_in_process(cfg)
    with provided(functions):
        check_callables(cfg.reward, resume)
        tracker = _tracker(tracker, cfg, run_dir)  # before the run directory is written: its errors leave none
        if not resume and (dataset is not None or eval_dataset is not None):
            claim_run_dir(run_dir, resume=False)  # refuse a used directory before writing anything into it
            _save_inputs(cfg, run_dir, dataset, eval_dataset)
        return run(cfg, run_dir, resume=resume, tracker=tracker, **{"execution": "embedded", **kw})


def _tracker(tracker: Tracker | TrackerFactory | None, cfg: RunConfig, run_dir: Path) -> Tracker | None:
    """A Tracker as given, or the one a factory builds for this run's final config and directory."""
    if tracker is None or hasattr(tracker, "log_metrics"):
        return tracker
    if not callable(tracker):
        what = type(tracker).__name__
        raise UserError(f"forge.train: tracker must be a Tracker or a callable (cfg, run_dir), not a {what}")
    return tracker(cfg, run_dir)


def _base_config(config: RunConfig | dict | None, preset: str | None) -> RunConfig:
    from forge.presets import get_preset

    if isinstance(config, RunConfig):
        if preset:
            raise UserError("forge.train: pass either a RunConfig or a preset, not both (a RunConfig is complete)")
        return copy.deepcopy(config)
    if config is None:
        return get_preset(preset or "tiny")
    if not isinstance(config, dict):
        raise UserError(f"forge.train: config must be a RunConfig, a dict or None, got {type(config).__name__}")
    # the keys the dict sets replace the preset's, section by section (as a YAML file over --preset does)
    return overlay(get_preset(preset) if preset else RunConfig(), config, "forge.train(config=...): ")


def _reward_specs(reward_funcs: Sequence[Callable | str] | None) -> tuple[list[str], dict[str, Callable]]:
    """(reward.verifiers entries, {'module:qualname': callable}) for reward_funcs (callables or verifier names)."""
    from forge.rewards.registry import callable_spec

    if reward_funcs is None:
        return [], {}
    if isinstance(reward_funcs, str) or callable(reward_funcs):
        reward_funcs = [reward_funcs]  # TRL accepts a single function too
    specs, functions = [], {}
    for i, fn in enumerate(reward_funcs):
        if isinstance(fn, str):
            specs.append(fn)
            continue
        if not callable(fn):
            raise UserError(f"forge.train: reward_funcs[{i}] is a {type(fn).__name__}, not a callable or a name")
        spec = callable_spec(fn)
        if spec in functions and functions[spec] is not fn:
            raise UserError(
                f"forge.train: two reward functions are both named '{spec}'; give each its own name (def ...)"
            )
        specs.append(spec)
        functions[spec] = fn
    return specs, functions


def _env_specs(factory: Callable | None, tools: Sequence[Callable] | None, functions: dict) -> list[str]:
    """['module:qualname' of the environment class (or ''), then of each tool]; each is added to `functions`."""
    from forge.rewards.registry import callable_spec

    out = []
    for what, obj in [("environment_factory", factory), *(("tools", t) for t in (tools or []))]:
        if obj is None:
            out.append("")
            continue
        if not callable(obj):
            raise UserError(f"forge.train: {what} must be a class or a function, not a {type(obj).__name__}")
        spec = callable_spec(obj)
        functions[spec] = obj
        out.append(spec)
    return out


def _resumed(run_dir, config, dataset, eval_dataset, overrides, specs) -> tuple[RunConfig, Path]:
    """The config of the run to resume (config.yaml + overrides); it keeps its data and reward functions."""
    if run_dir is None:
        raise UserError("forge.train(resume=True) needs run_dir: the run directory to continue")
    if config is not None or dataset is not None or eval_dataset is not None:
        raise UserError(
            "forge.train(resume=True) continues with the run's own config.yaml and data: drop config, dataset and "
            "eval_dataset (use overrides=[...] to change settings)"
        )
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"cannot resume '{run_dir}': no such run (config.yaml missing)")
    cfg = apply_overrides(load_yaml(run_dir / "config.yaml"), list(overrides))
    if specs and specs != cfg.reward.verifiers:
        raise UserError(
            f"forge.train(resume=True): reward_funcs name {specs}, but the run was started with "
            f"{cfg.reward.verifiers}; pass the same functions in the same order"
        )
    return cfg, run_dir



def _check_in_process(cfg: RunConfig) -> None:
    r, u = cfg.rollout, cfg.update
    if r.backend == "vllm" or r.replicas > 1 or u.num_processes > 1 or cfg.algo.max_staleness > 0:
        raise ConfigError(
            "forge.train runs every stage in this process: rollout.backend=vllm, rollout.replicas>1, "
            "update.num_processes>1 and algo.max_staleness>0 need several; use `forgeweave run` for those"
        )


def _save_inputs(cfg: RunConfig, run_dir: Path, dataset: Any, eval_dataset: Any) -> None:
    """Save the given datasets under run_dir/inputs/ and point data.source / data.eval_source at them."""
    for data, name, key in ((dataset, "train", "source"), (eval_dataset, "eval", "eval_source")):
        if data is not None:
            path = save_dataset(_as_dataset(data, "dataset" if name == "train" else "eval_dataset"),
                                run_dir / INPUTS / name)  # fmt: skip
            setattr(cfg.data, key, str(path.resolve()))


def _as_dataset(data: Any, what: str):
    """A datasets.Dataset / DatasetDict as given, or one built from a list of dicts."""
    import datasets
    import pyarrow as pa

    if isinstance(data, datasets.Dataset | datasets.DatasetDict):
        return data
    if not (isinstance(data, list) and data and all(isinstance(r, dict) for r in data)):
        raise UserError(
            f"forge.train: {what} must be a datasets.Dataset, a DatasetDict or a non-empty list of dicts, got "
            f"{type(data).__name__}"
        )
    try:
        return datasets.Dataset.from_list(data)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"forge.train: {what} rows do not fit one type per column ({first}); make each column one type"
        ) from None


def save_dataset(ds, target: Path) -> Path:
    """`ds.save_to_disk` into `target`, atomically (a temporary directory beside it, then renamed)."""
    from forge.data import quiet_datasets

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        with quiet_datasets():
            ds.save_to_disk(str(tmp / "ds"))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp / "ds", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
