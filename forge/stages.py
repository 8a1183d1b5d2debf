"""The stage seam of the GRPO loop: which workers do the stages (`Stages`) and how each call is run (`StageRunner`).

The loop in `forge.recipes.grpo` calls `runner(stage, step, fn, *args)` for every stage, where `fn` is a method of a
`Stages` object. Two seams, each with one small interface:

- **where** a stage runs: `Stages`. `LocalStages` keeps the workers (`forge.workers`) in this process — one update
  process, the hf rollout sampling from the trainer's own module (weight sync is free). The Ray adapter
  (`flows/ray_exec.py`) implements the same methods over long-lived actors placed by Weaver.
- **how** a call is run: `StageRunner`. `call_stage` calls the function; the Prefect flow turns each call into a
  task run (`flows/pipeline.py`). Neither has a loop of its own.

Every method takes its inputs and returns its record; nothing is left on a shared object for a later stage.
A `WorkerLost` error (an actor died) is what the loop recovers from by rebuilding the stages and resuming from
the last checkpoint (`orchestration.max_restarts`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from forge.checkpoint import SaveReport
from forge.config import RunConfig
from forge.records import Rollouts, Scored, ScoredBatch, UpdateStats
from forge.rollout import SamplingParams
from forge.workers import RewardWorker, RolloutWorker, TrainerWorker


class WorkerLost(RuntimeError):
    """A stage worker died (its process or node is gone): the loop rebuilds the stages and resumes."""


class StageRunner(Protocol):
    def __call__(self, stage: str, step: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` as stage `stage` of step `step` and return its result."""
        ...


def call_stage(stage: str, step: int, fn: Callable[..., Any], *args: Any) -> Any:
    """The plain runner: a function call."""
    return fn(*args)


class Stages(Protocol):
    """What the loop asks of the workers, wherever they run."""

    policy_version: int

    def rollout(self, prompts: list[str], params: SamplingParams) -> Rollouts: ...

    def reward(self, rows: list[dict], rollouts: Rollouts, step: int) -> Scored: ...

    def update(self, batch: ScoredBatch) -> UpdateStats:
        """One update; the rollout workers then hold the new weights (`sync_seconds`: moving them)."""
        ...

    def evaluate(self, rows: list[dict], step: int) -> dict: ...

    def save(self, root: Path, step: int, payload: dict, eval_score: float | None) -> None:
        """Start checkpoint `step` (every update rank snapshots; written in the background unless
        `checkpoint.async_save` is off); the save in flight, if any, finishes first."""
        ...

    def wait_saved(self) -> SaveReport | None:
        """Wait for the save in flight; its report (None if there was none); raises a failed save's error."""
        ...

    def restore(self, ckpt: Path, reward_state: dict | None, rollout_rng: list | None) -> None:
        """Trainer (weights, optimizer), reward state and the rollout workers' RNG streams from a checkpoint;
        the rollout workers get the weights."""
        ...

    def reward_state(self) -> dict | None: ...

    def rollout_rng(self) -> list:
        """Each rollout worker's RNG stream state (for the checkpoint)."""
        ...

    def where(self) -> dict[str, list[dict]]:
        """stage -> one entry per worker: host, pid, devices, threads (and node id under Ray)."""
        ...

    def close(self) -> None: ...


StagesFactory = Callable[[RunConfig, Path, dict | None], Stages]


class LocalStages:
    """All workers in this process: one update process; the rollout shares the trainer's module."""

    def __init__(self, cfg: RunConfig, run_dir: Path, plan: dict | None = None):
        self.trainer = TrainerWorker(cfg)
        model = self.trainer.trainer.unwrapped
        self.rollout_worker = RolloutWorker(cfg, model=model, tokenizer=self.trainer.tokenizer)
        self.reward_worker = RewardWorker(cfg)

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    def rollout(self, prompts: list[str], params: SamplingParams) -> Rollouts:
        return self.rollout_worker.generate(prompts, params, self.policy_version)

    def reward(self, rows: list[dict], rollouts: Rollouts, step: int) -> Scored:
        return self.reward_worker.score(rows, rollouts, step)

    def update(self, batch: ScoredBatch) -> UpdateStats:
        stats, _ = self.trainer.step(batch, publish=False)
        self.rollout_worker.load_weights(None, stats.policy_version)  # the same module: nothing moves
        return stats

    def evaluate(self, rows: list[dict], step: int) -> dict:
        return self.rollout_worker.evaluate(rows, step, self.policy_version)

    def save(self, root: Path, step: int, payload: dict, eval_score: float | None) -> None:
        self.trainer.save(str(root), step, payload, eval_score)

    def wait_saved(self) -> SaveReport | None:
        return self.trainer.wait_saved()

    def restore(self, ckpt: Path, reward_state: dict | None, rollout_rng: list | None) -> None:
        version = self.trainer.restore(str(ckpt))
        self.rollout_worker.load_weights(None, version)
        self.reward_worker.load_state_dict(reward_state)
        if rollout_rng:
            self.rollout_worker.set_rng_state(rollout_rng[0])

    def reward_state(self) -> dict | None:
        return self.reward_worker.state_dict()

    def rollout_rng(self) -> list:
        return [self.rollout_worker.rng_state()]

    def where(self) -> dict[str, list[dict]]:
        return {
            "rollout": [self.rollout_worker.where()],
            "reward": [self.reward_worker.where()],
            "update": [self.trainer.where()],
        }

    def close(self) -> None:
        self.rollout_worker.close()
