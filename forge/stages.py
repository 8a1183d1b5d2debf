"""The stage seam of the GRPO loop: which workers do the stages (`Stages`) and how each call is run (`StageRunner`).

The loop in `forge.recipes.grpo` calls `runner(stage, step, fn, *args)` for every stage, where `fn` is a method of a
`Stages` object. Two seams, each with one small interface:

- **where** a stage runs: `Stages`. `LocalStages` keeps the workers (`forge.workers`) in this process — one update
  process, the hf rollout sampling from the trainer's own module (weight sync is free). The Ray adapter
  (`flows/ray_exec.py`) implements the same methods over long-lived actors placed by Weaver.
- **how** a call is run: `StageRunner`. `call_stage` calls the function; the Prefect flow turns each call into a
  task run (`flows/pipeline.py`). Neither has a loop of its own.

Every method takes its inputs and returns its record; nothing is left on a shared object for a later stage.
A step's rollout and reward are started together (`start`, which only submits) and waited on separately
(`rollout`, `reward`): that is what lets asynchronous GRPO (`algo.max_staleness`) sample later steps while the
trainer updates, with the same loop.
A `WorkerLost` error (an actor died) is what the loop recovers from by rebuilding the stages and resuming from
the last checkpoint (`orchestration.max_restarts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forge.checkpoint import SaveReport
from forge.config import RunConfig
from forge.data import train_row_count
from forge.errors import UserError
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

    def start(self, rows: list[dict], prompts: list[str], params: SamplingParams, step: int) -> Any:
        """Start step `step`'s rollout from the current policy version, and its scoring once it is done; returns
        the handle `rollout` and `reward` wait on. Submits and returns: under Ray the work runs while the loop
        goes on (asynchronous GRPO starts the rollouts of later steps before this step's update)."""
        ...

    def rollout(self, started: Any) -> Rollouts:
        """The started step's completions (waits for them)."""
        ...

    def reward(self, started: Any) -> Scored:
        """The started step's scores, rewards and advantages (waits for them)."""
        ...

    def update(self, batch: ScoredBatch) -> UpdateStats:
        """One update; the rollout workers then hold the new weights (`sync_seconds`: moving them)."""
        ...

    def evaluate(self, rows: list[dict], step: int, probe: bool = False) -> dict:
        """The eval report of the current policy on `rows`; `probe`: greedy pass@1 and mean reward only."""
        ...

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


@dataclass
class LocalStep:
    """A started step in-process: its inputs, the policy version it must sample from, its rollouts once done."""

    rows: list[dict]
    prompts: list[str]
    params: SamplingParams
    step: int
    version: int
    rng: dict | None = None  # the sampling stream when the step started: a retried rollout samples the same again
    rollouts: Rollouts | None = None


class LocalStages:
    """All workers in this process: one update process; the rollout shares the trainer's module."""

    def __init__(self, cfg: RunConfig, run_dir: Path, plan: dict | None = None):
        if cfg.algo.max_staleness > 0:  # the rollout samples from the trainer's own module: no older weights exist
            raise UserError(
                "algo.max_staleness > 0 needs the rollout in a process of its own: run it with "
                "orchestration.execution=ray (or auto), or set algo.max_staleness=0"
            )
        self.trainer = TrainerWorker(cfg)
        model = self.trainer.trainer.unwrapped
        self.rollout_worker = RolloutWorker(cfg, model=model, tokenizer=self.trainer.tokenizer)
        self.reward_worker = RewardWorker(cfg, train_row_count(run_dir))

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    def start(self, rows: list[dict], prompts: list[str], params: SamplingParams, step: int) -> LocalStep:
        """In-process nothing runs ahead: the step's work runs when the loop asks for its results."""
        return LocalStep(rows, prompts, params, step, self.policy_version, self.rollout_worker.rng_state())

    def rollout(self, started: LocalStep) -> Rollouts:
        if started.rollouts is None:  # a retry after a failure samples again, from the same RNG state; a second
            self.rollout_worker.set_rng_state(started.rng)  # call does not sample at all
            started.rollouts = self.rollout_worker.generate(started.prompts, started.params, started.version)
        return started.rollouts

    def reward(self, started: LocalStep) -> Scored:
        return self.reward_worker.score(started.rows, self.rollout(started), started.step)

    def update(self, batch: ScoredBatch) -> UpdateStats:
        stats, _ = self.trainer.step(batch, publish=False)
        self.rollout_worker.load_weights(None, stats.policy_version)  # the same module: nothing moves
        return stats

    def evaluate(self, rows: list[dict], step: int, probe: bool = False) -> dict:
        return self.rollout_worker.evaluate(rows, step, self.policy_version, probe)

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
