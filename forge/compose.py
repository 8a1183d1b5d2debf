"""The run config taken apart: each component built from the sections it reads (part of the config composite).

Components take their own config sections and plain values (`Trainer(model, update, algo, ...)`,
`RolloutWorker(rollout=..., env=..., eval=...)`, `RewardWorker(reward, distill=...)`); only `forge.config`, this module,
`forge.config_compat`, `forge.presets` and the API (`forge.api`, `forge.recipes.grpo`, `forge.recipes.wiring`) know
`RunConfig` (tests/test_config_sections.py). Here a cross-section value is computed once and passed as a value: the
step's episode count (B * G), the rollout's temperature for the trainer's log-probs.

- `local_stages(cfg, run_dir, plan, micro_update)`: the recipe's in-process `StagesFactory`.
- `trainer_worker`, `rollout_worker`, `reward_worker`, `teacher_worker`: the stage workers (the Ray actors build
  theirs through these too: `flows/ray_actor.py`); `trainer`, `teacher`: the components inside them.
- `data_sources(cfg)`: what the prep stage reads; `environment(cfg, tok)`: a multi-turn run's environment.
- `resume_changes`, `record_changes`: a resume's config changes against the run's config.yaml.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from forge.config import RunConfig, config_diff, dump_yaml, load_yaml
from forge.data.prepare import DataSources
from forge.errors import UserError

if TYPE_CHECKING:
    from forge.rewards.teacher import Teacher
    from forge.stages import LocalStages, Stages
    from forge.trainer import MicroUpdate, Trainer
    from forge.workers import RewardWorker, RolloutWorker, TeacherWorker, TrainerWorker

# (the run config, run_dir, Weaver's plan, the recipe's micro-batch update) -> the run's stages
StagesFactory = Callable[[RunConfig, Path, "dict | None", "MicroUpdate"], "Stages"]


def trainer(model, cfg: RunConfig, total_steps: int, **kwargs) -> Trainer:
    """`forge.trainer.Trainer` over `model` with the run's update and algo sections (kwargs: ref_model, accelerator,
    micro_update)."""
    from forge.trainer import Trainer

    r = cfg.rollout
    return Trainer(model, cfg.update, cfg.algo, total_steps, seed=cfg.seed, temperature=r.temperature,
                   max_new_tokens=r.max_new_tokens, **kwargs)  # fmt: skip


def trainer_worker(cfg: RunConfig, **kwargs) -> TrainerWorker:
    """One update rank (kwargs: model, tokenizer, rank, world, master_addr, master_port, local_rank, micro_update)."""
    from forge.workers import TrainerWorker

    return TrainerWorker(model_cfg=cfg.model, update=cfg.update, algo=cfg.algo, rollout=cfg.rollout,
                         checkpoint=cfg.checkpoint, seed=cfg.seed, steps=cfg.steps, threads=cfg.threads,
                         **kwargs)  # fmt: skip


def rollout_worker(cfg: RunConfig, **kwargs) -> RolloutWorker:
    """The rollout and evaluate stages' worker (kwargs: model, tokenizer, work_dir)."""
    from forge.workers import RolloutWorker

    return RolloutWorker(model_cfg=cfg.model, rollout=cfg.rollout, env=cfg.env, eval=cfg.eval, reward=cfg.reward,
                         seed=cfg.seed, threads=cfg.threads, max_staleness=cfg.algo.max_staleness,
                         answer_column=cfg.data.answer_column, **kwargs)  # fmt: skip


def teacher(cfg: RunConfig) -> Teacher:
    """The distillation teacher of `distill.teacher`, loaded."""
    from forge.rewards.teacher import Teacher

    r = cfg.rollout
    return Teacher(cfg.distill, cfg.model, batch_size=r.batch_size, temperature=r.temperature,
                   autocast_bf16=cfg.update.autocast_bf16)  # fmt: skip


def reward_worker(cfg: RunConfig, train_rows: int = 0) -> RewardWorker:
    """The reward stage's worker (distilling, `score` is given the teacher stage's scores)."""
    from forge.workers import RewardWorker

    return RewardWorker(cfg.reward, advantage=cfg.algo.advantage, seed=cfg.seed, steps=cfg.steps,
                        prompts_per_step=cfg.rollout.prompts_per_step, answer_column=cfg.data.answer_column,
                        train_rows=train_rows, distill=cfg.distill)  # fmt: skip


def teacher_worker(cfg: RunConfig) -> TeacherWorker:
    """The distillation teacher as a worker of its own (Ray mode)."""
    from forge.workers import TeacherWorker

    r = cfg.rollout
    return TeacherWorker(cfg.distill, cfg.model, batch_size=r.batch_size, temperature=r.temperature,
                         autocast_bf16=cfg.update.autocast_bf16, seed=cfg.seed, threads=cfg.threads)  # fmt: skip


def local_workers(cfg: RunConfig, run_dir: Path, micro_update: MicroUpdate
                  ) -> tuple[TrainerWorker, RolloutWorker, RewardWorker, Teacher | None]:  # fmt: skip
    """The in-process workers (and, with `distill.teacher`, the teacher); the rollout samples from the trainer's
    own module."""
    from forge.data import train_row_count

    if cfg.algo.max_staleness > 0:  # the rollout samples from the trainer's own module: no older weights exist
        raise UserError(
            "algo.max_staleness > 0 needs the rollout in a process of its own: run it with "
            "orchestration.execution=ray (or auto), or set algo.max_staleness=0"
        )
    update = trainer_worker(cfg, micro_update=micro_update)
    rollout = rollout_worker(cfg, model=update.trainer.unwrapped, tokenizer=update.tokenizer)
    return update, rollout, reward_worker(cfg, train_row_count(run_dir)), teacher(cfg) if cfg.distill.teacher else None


def local_stages(cfg: RunConfig, run_dir: Path, plan: dict | None, micro_update: MicroUpdate) -> LocalStages:
    """The recipe's in-process `StagesFactory`: every worker in this process (`forge.stages.LocalStages`)."""
    from forge.stages import LocalStages

    return LocalStages(*local_workers(cfg, run_dir, micro_update))


def environment(cfg: RunConfig, tok) -> tuple:
    """A multi-turn run's (environment factory, tools, chat format) (`forge.env.load.load_environment`)."""
    from forge.env.load import load_environment

    r = cfg.rollout
    return load_environment(cfg.env, cfg.model, cfg.reward.code_exec, r.prompts_per_step * r.group_size, tok)


def data_sources(cfg: RunConfig) -> DataSources:
    """What the prep stage reads (`forge.data.prepare`)."""
    return DataSources(cfg.data, cfg.seed, cfg.reward.label_free, cfg.collapse.probe_source)


def resume_changes(run_dir: Path, cfg: RunConfig, ckpt: Path | None) -> dict[str, list]:
    """Key -> [saved, new] for what `cfg` changes against the run's config.yaml; a change the checkpoint `ckpt`
    cannot honour is a ConfigError naming the key (with no checkpoint yet the run starts over: anything goes)."""
    from forge.resume import check_resume_changes, checkpoint_step

    changes = config_diff(load_yaml(Path(run_dir) / "config.yaml"), cfg)
    if ckpt is not None:
        check_resume_changes(changes, checkpoint_step(ckpt), cfg.steps)
    return changes


def record_changes(run_dir: Path, cfg: RunConfig, changes: dict[str, list], step: int) -> None:
    """config.yaml := `cfg`, then `forge.resume.write_changes` appends what changed at `step`."""
    from forge.resume import write_changes

    write_changes(Path(run_dir), dump_yaml(cfg), changes, step)
