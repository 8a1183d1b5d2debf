"""The stage seam of the GRPO loop: the stages (`Stage`), the workers that do them (`Stages`) and how each call is
run (`StageRunner`).

The loop in `forge.recipes.grpo` calls `runner(Stage.X, step, fn, *args)` for every stage and for nothing else
(its bookkeeping is `forge.loop`, outside the seam), where `fn` is a method of a `Stages` object:

- **where** a stage runs: `Stages`. `LocalStages` keeps the workers (`forge.workers`; built from the run config by
  `forge.compose.local_stages`, the recipe's default `StagesFactory`) in this process — one update
  process, the hf rollout sampling from the trainer's own module (weight sync is free). The Ray adapter
  (`flows/ray_exec.py`) implements the same methods over long-lived actors placed by Weaver.
- **how** a call is run: `StageRunner`. `call_stage` calls the function; the Prefect flow turns each call into a
  task run (`flows/pipeline.py`), retried where `Stage.retry_safe` says so. Neither has a loop of its own.

Every stage method takes its inputs and returns its record (the reward stage takes the rollouts and returns their
scores); nothing is left on a shared object for a later stage. A stage call does its work when called, so a retry
re-runs it in every mode: a retried rollout samples the same batch again (its request carries the step's seed).
Asynchronous
GRPO (`algo.max_staleness`) only adds `prefetch`, which starts a later step's rollout early on a Ray actor; its
`rollout` call then collects it (or, if it failed, samples it again).
A `WorkerLost` error (an actor died) is what the loop recovers from by rebuilding the stages and resuming from
the last checkpoint (`orchestration.max_restarts`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from forge.checkpoint import SaveReport
from forge.records import RolloutRequest, Rollouts, ScoredBatch, UpdateStats
from forge.rewards.teacher import Teacher, TeacherScores
from forge.workers import RewardWorker, RolloutWorker, TrainerWorker


class Stage(enum.Enum):
    """The stages the loop runs through the seam; `retry_safe`: a repeat gives the same result for its step."""

    PREPARE = "prepare"  # writes data/ atomically from the config: the same files again
    ROLLOUT = "rollout"  # sampled from the step's derived seed: the same samples again
    TEACHER = "teacher"  # distilling: the teacher's log-probs of the samples, teacher-forced: the same again
    REWARD = "reward"  # pure scores; the ensemble replaces its entry for the step
    UPDATE = "update"  # never repeated: a second attempt would take a second optimizer step
    EVALUATE = "evaluate"  # measures only (seeded)
    PROBE = "probe"  # measures only; the collapse guard decides outside the call
    CHECKPOINT = "checkpoint"  # rewritten atomically

    @property
    def retry_safe(self) -> bool:
        return self is not Stage.UPDATE


class WorkerLost(RuntimeError):
    """A stage worker died (its process or node is gone): the loop rebuilds the stages and resumes."""


class StageRunner(Protocol):
    def __call__(self, stage: Stage, step: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` as stage `stage` of step `step` and return its result."""
        ...


def call_stage(stage: Stage, step: int, fn: Callable[..., Any], *args: Any) -> Any:
    """The plain runner: a function call."""
    return fn(*args)


class Stages(Protocol):
    """What the loop asks of the workers, wherever they run."""

    policy_version: int

    def prefetch(self, request: RolloutRequest) -> None:
        """Start `request`'s rollout now, if the workers can sample while the loop goes on (Ray); else nothing."""
        ...

    def rollout(self, request: RolloutRequest) -> Rollouts:
        """The request's completions, sampled from its policy version with its seed (collects a prefetched one)."""
        ...

    def teacher(self, rollouts: Rollouts) -> TeacherScores:
        """The distillation teacher's log-probs of the rollouts' sampled tokens (and its top k with distill.topk);
        asked only when the run distills (`distill.teacher`)."""
        ...

    def reward(self, rows: list[dict], rollouts: Rollouts, step: int,
               teacher: TeacherScores | None = None) -> ScoredBatch:  # fmt: skip
        """Per-verifier scores, rewards and group advantages of step `step`'s rollouts of `rows` (distilling, plus
        the teacher's per-token term from `teacher`)."""
        ...

    def update(self, rollouts: Rollouts, advantages: torch.Tensor, teacher: TeacherScores | None = None) -> UpdateStats:
        """One update; the rollout workers then hold the new weights (`sync_seconds`: moving them). `teacher`: the
        teacher stage's scores, whose top k's KL the loss adds (distill.topk)."""
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

    def restore(self, ckpt: Path, reward_state: dict | None) -> None:
        """Trainer (weights, optimizer) and reward state from a checkpoint; the rollout workers get the weights."""
        ...

    def reward_state(self) -> dict | None: ...

    def where(self) -> dict[str, list[dict]]:
        """stage -> one entry per worker: host, pid, devices, threads (and node id under Ray)."""
        ...

    def close(self) -> None: ...


class LocalStages:
    """All workers in this process: one update process; the rollout samples from the trainer's own module
    (`rollout_worker` was built on `trainer`'s model: weight sync is free)."""

    def __init__(self, trainer: TrainerWorker, rollout_worker: RolloutWorker, reward_worker: RewardWorker,
                 teacher: Teacher | None = None):  # fmt: skip
        self.trainer, self.rollout_worker, self.reward_worker = trainer, rollout_worker, reward_worker
        self.teacher_model = teacher  # distill.teacher, loaded once (None: the run does not distill)

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    def prefetch(self, request: RolloutRequest) -> None:
        """In-process nothing runs ahead: the rollout samples when the loop asks for it."""

    def rollout(self, request: RolloutRequest) -> Rollouts:
        """Sampled with the request's seed: a retry samples the same batch again."""
        return self.rollout_worker.generate(request.prompts, request.params, request.policy_version, request.rows)

    def teacher(self, rollouts: Rollouts) -> TeacherScores:
        assert self.teacher_model is not None, "the teacher stage runs only when the run distills"
        return self.teacher_model.logprobs(rollouts)

    def reward(self, rows: list[dict], rollouts: Rollouts, step: int,
               teacher: TeacherScores | None = None) -> ScoredBatch:  # fmt: skip
        return self.reward_worker.score(rows, rollouts, step, teacher)

    def update(self, rollouts: Rollouts, advantages: torch.Tensor, teacher: TeacherScores | None = None) -> UpdateStats:
        stats = self.trainer.step(rollouts, advantages, None if teacher is None else teacher.topk)
        self.rollout_worker.load_weights(None, stats.policy_version)  # the same module: nothing moves
        return stats

    def evaluate(self, rows: list[dict], step: int, probe: bool = False) -> dict:
        return self.rollout_worker.evaluate(rows, step, self.policy_version, probe)

    def save(self, root: Path, step: int, payload: dict, eval_score: float | None) -> None:
        self.trainer.save(str(root), step, payload, eval_score)

    def wait_saved(self) -> SaveReport | None:
        return self.trainer.wait_saved()

    def restore(self, ckpt: Path, reward_state: dict | None) -> None:
        version = self.trainer.restore(str(ckpt))
        self.rollout_worker.load_weights(None, version)
        self.reward_worker.load_state_dict(reward_state)

    def reward_state(self) -> dict | None:
        return self.reward_worker.state_dict()

    def where(self) -> dict[str, list[dict]]:
        return {
            "rollout": [self.rollout_worker.where()],
            "reward": [self.reward_worker.where()],
            "update": [self.trainer.where()],
        }

    def close(self) -> None:
        self.rollout_worker.close()
