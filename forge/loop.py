"""The bookkeeping around the GRPO loop (`forge.recipes.grpo`), in small named parts that know nothing of the math:

- `Run`: the run's context, built once by the recipe (the workers, the stage runner, the data, the record, the
  schedule and the few settings the loop reads); frozen.
- `LoopState`: everything that changes from step to step (the guard's state, rollouts started ahead, restarts, the
  prompt offset, ...), a frozen record: every helper is `f(run, state, step) -> LoopState`, none mutates its arguments.
- `Schedule`: which steps evaluate, probe and checkpoint.
- `verifier_streaks`, `update_streak` + `stop_reason`: the stop rules (a verifier failing on every item,
  non-finite updates), as pure functions that return a new state or a reason instead of raising.
- `Data`: the prepared splits; a step's prompts are derived from (seed, step) (`prompts_of`), nothing is carried.
- `restore` / `recover`: the loop state back from a checkpoint (resume, a rollback, a worker lost); a damaged or
  missing checkpoint is never restored: `recover` falls back to the newest intact one and `rollback_target` to the
  newest intact one before the best probe's, with one line saying so (`forge.checkpoint.resume_checkpoint` /
  `newest_intact`), or the run stops with one line.
- `collect_saved`: waits for the checkpoint in flight and records it (at most one is in flight).
- `Record`: what the loop asks of the run's record (`forge.recipes.wiring.RunRecord` writes the run directory and
  the tracker).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from forge.checkpoint import (
    SaveReport,
    checkpoint_problem,
    load_state,
    newest_intact,
    remove_partial,
    resume_checkpoint,
    score_of,
    step_dir_name,
)
from forge.data import check_data_hash, next_row, prompt_batch, read_probe, read_split, sampler_state
from forge.errors import UserError
from forge.guard import CollapseConfig, CollapseGuard
from forge.metrics import error_line
from forge.records import RolloutRequest, Rollouts, ScoredBatch, UpdateStats
from forge.rollout.base import SamplingParams, rollout_seed

if TYPE_CHECKING:
    from forge.stages import StageRunner, Stages


def due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


@dataclass(frozen=True)
class Schedule:
    """When the loop evaluates, probes (collapse guard) and checkpoints; the last step always does all three."""

    steps: int
    eval_every: int
    checkpoint_every: int
    probe_every: int  # 0 = no probe set
    restores: bool  # the guard may roll back or stop: a checkpoint at every probe step too

    @classmethod
    def of(cls, steps: int, eval_every: int, checkpoint_every: int, collapse: CollapseConfig) -> Schedule:
        probed = bool(collapse.probe_source)
        restores = probed and collapse.action in ("stop", "rollback")
        probe_every = (collapse.probe_every or eval_every) if probed else 0
        return cls(steps, eval_every, checkpoint_every, probe_every, restores)

    def eval_due(self, step: int) -> bool:
        return due(step, self.eval_every, self.steps)

    def probe_due(self, step: int) -> bool:
        return bool(self.probe_every) and due(step, self.probe_every, self.steps)

    def checkpoint_due(self, step: int) -> bool:
        return due(step, self.checkpoint_every, self.steps) or (self.restores and self.probe_due(step))

    def next_checkpoint(self, step: int) -> int:
        """The first checkpoint step at or after `step`: asynchronous rollouts never start past it."""
        every = [e for e in (self.checkpoint_every, self.probe_every if self.restores else 0) if e > 0]
        return min([self.steps, *(-(-step // e) * e for e in every)])


@dataclass(frozen=True)
class LoopState:
    """Everything that changes while the run goes; `payload` is the part a checkpoint saves (with `step`)."""

    step: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds over the run
    initial_eval: dict | None = None
    last_eval: dict | None = None
    skipped: int = 0  # updates skipped in a row (non-finite loss or gradient)
    failing: dict[str, int] = field(default_factory=dict)  # verifier -> steps in a row it erred on every item
    env_failing: int = 0  # steps in a row on which the environment failed every episode
    env_error: str = ""  # the environment's failure on the last such step
    stopped: str = ""  # why the collapse guard ended the run early
    last_reward: float | None = None  # the last step's reward/mean (the progress bar)
    saving: tuple[int, float] | None = None  # the checkpoint in flight: (step, seconds the loop waited to start it)
    saved: SaveReport | None = None  # the last durable checkpoint
    guard: CollapseGuard | None = None  # the collapse guard's state (None: no probe set)
    ahead: tuple[RolloutRequest, ...] = ()  # rollouts started for later steps (asynchronous GRPO)
    row_offset: int = 0  # step t's first prompt is row row_offset + (t - 1) * B of the order (forge.data.sampler)
    restarts: int = 0  # times the workers were rebuilt after one was lost
    shown_errors: frozenset = frozenset()  # (verifier, error text) pairs printed so far

    def timed(self, laps: dict[str, float]) -> LoopState:
        seconds = dict(self.seconds)
        for k, v in laps.items():
            seconds[k] = seconds.get(k, 0.0) + v
        return dataclasses.replace(self, seconds=seconds)

    def payload(self) -> dict:
        return {"seconds": dict(self.seconds), "initial_eval": self.initial_eval, "last_eval": self.last_eval,
                "guard": self.guard.state_dict() if self.guard else None}  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """The stop rules' limits (reward.max_failing_steps, update.max_skipped_steps)."""

    max_failing_steps: int
    max_skipped_steps: int


@dataclass(frozen=True)
class Run:
    """The run's context: built once by the recipe and never changed (a lost worker gives a new Run with rebuilt
    `work`). `sampling` is the step's sampling parameters but the seed, derived per step (`request_of`)."""

    work: Stages
    runner: StageRunner
    data: Data
    record: Record
    sched: Schedule
    seed: int
    batch: int  # B: prompts per step
    sampling: SamplingParams
    max_staleness: int  # algo.max_staleness: rollouts started up to this many steps ahead
    limits: Limits
    probe_rows: int  # collapse.probe_max_problems
    async_save: bool  # checkpoint.async_save
    distills: bool  # distill.teacher is set: each step runs the teacher stage


def verifier_streaks(state: LoopState, batch: ScoredBatch) -> LoopState:
    """Per verifier, the steps in a row on which it erred on every item (raised, or returned something that is not a
    score; None is not an error), this step's scores counted."""
    n = batch.scores.shape[0]
    failing = {v: state.failing.get(v, 0) + 1 if n and batch.verifier_errored.get(v, 0) == n else 0
               for v in batch.verifier_names}  # fmt: skip
    return dataclasses.replace(state, failing=failing)


def environment_streak(state: LoopState, rollouts: Rollouts) -> LoopState:
    """Steps in a row on which the environment failed every episode (an OpenEnv server gone, every agent raising),
    this step counted; such a step says so in one line (the commonest reason)."""
    failures = rollouts.episodes.failures if rollouts.episodes is not None else []
    if failures and all(failures):
        (why, count), *others = sorted(Counter(failures).items(), key=lambda kv: (-kv[1], kv[0]))
        say(f"forgeweave: step {state.step}: every episode failed ({len(failures)}); {count} with: {error_line(why)}"
            + (f" (and {len(others)} other reason{'s' * (len(others) > 1)})" if others else ""))  # fmt: skip
        return dataclasses.replace(state, env_failing=state.env_failing + 1, env_error=failures[0])
    return dataclasses.replace(state, env_failing=0, env_error="")


def update_streak(state: LoopState, stats: UpdateStats) -> LoopState:
    """Updates skipped in a row for a non-finite loss or gradient norm, this step's counted."""
    return dataclasses.replace(state, skipped=state.skipped + 1 if stats.skipped else 0)


def stop_reason(state: LoopState, batch: ScoredBatch, limits: Limits) -> str:
    """Why the run must stop after this step ("" = it goes on): a verifier that failed on every item for
    reward.max_failing_steps steps (training on the zeros it leaves would teach nothing), an environment that failed
    every episode for as many, or update.max_skipped_steps non-finite updates in a row (the weights are still the
    last finite ones, as is every checkpoint)."""
    limit = limits.max_failing_steps
    if limit and state.env_failing >= limit:
        return (f"step {state.step}: the environment failed every episode for {state.env_failing} steps in a row "
                f"(reward.max_failing_steps={limit}): {error_line(state.env_error)}; bring the environment server "
                "back (or fix the agent, env.agent.fn / env.agent.command), then --resume")  # fmt: skip
    for name, count in state.failing.items():
        if limit and count >= limit:
            return (f"step {state.step}: verifier '{name}' failed on every item for {count} steps in a row "
                    f"(reward.max_failing_steps={limit}): {error_line(batch.verifier_errors.get(name, ''))}; fix the "
                    "verifier (or set reward.max_failing_steps=0), then --resume")  # fmt: skip
    if state.skipped >= (cap := limits.max_skipped_steps):
        return (f"step {state.step}: {cap} updates in a row had a non-finite loss or gradient norm and were skipped "
                f"(update.max_skipped_steps={cap}); check the rewards and lower update.lr, then --resume")  # fmt: skip
    return ""


@dataclass(frozen=True)
class Data:
    """The prepared splits, checked against the manifest's hash."""

    train: list[dict]
    eval: list[dict]
    probe: list[dict] | None
    hash: str

    @classmethod
    def read(cls, run_dir: Path) -> Data:
        train, eval_, probe = read_split(run_dir, "train"), read_split(run_dir, "eval"), read_probe(run_dir)
        digest = check_data_hash(run_dir, train, eval_, probe=probe)
        return cls(train, eval_, probe, digest)


class Record(Protocol):
    """What the loop asks of the run's record (the run directory and the tracker; rank 0 / the driver)."""

    run_dir: Path

    def truncate(self, step: int) -> None: ...
    def status(self, state: str, step: int) -> None: ...
    def probe_log(self, events: list[dict]) -> None: ...
    def checkpoint(self, step: int, report: SaveReport, *, stall: float, total: float, last: bool) -> None: ...


def prompts_of(run: Run, state: LoopState, step: int) -> list[dict]:
    """Step `step`'s B training rows, derived from (seed, step) and the state's offset."""
    return prompt_batch(run.data.train, run.seed, state.row_offset + (step - 1) * run.batch, run.batch)


def request_of(run: Run, state: LoopState, step: int) -> RolloutRequest:
    """Step `step`'s rollout request from the policy the trainer holds now: its prompts and its derived seed."""
    rows = prompts_of(run, state, step)
    params = dataclasses.replace(run.sampling, seed=rollout_seed(run.seed, step))
    return RolloutRequest(step, rows, [row["model_input"] for row in rows], params, run.work.policy_version)


def sampler_payload(run: Run, state: LoopState, step: int) -> dict:
    """The checkpoint's record of the prompt order after step `step` (forge.data.sampler_state)."""
    return sampler_state(run.seed, len(run.data.train), state.row_offset + step * run.batch)


def restore(run: Run, state: LoopState, ckpt: Path) -> LoopState:
    """Resume from checkpoint `ckpt`: the workers' state, the guard, the prompt offset (a resume that changed the
    batch size continues at the next row); what was recorded after it is cut (those steps are redone). `state`:
    the one it replaces (its restarts and printed errors go on)."""
    remove_partial(ckpt.parent)  # what a killed save left behind (no save is in flight now)
    saved, data = load_state(ckpt), run.data
    check_data_hash(run.record.run_dir, data.train, data.eval, saved.get("data_hash"), data.probe)
    run.work.restore(ckpt, saved.get("aggregator"))
    run.record.truncate(saved["step"])
    guard = state.guard.loaded(saved.get("guard")) if state.guard is not None else None
    if guard is not None:
        run.record.probe_log(list(guard.events))  # firings after the checkpoint are redone
    run.record.status("running", saved["step"])
    offset = next_row(saved["sampler"], len(data.train)) - saved["step"] * run.batch
    return LoopState(saved["step"], saved["seconds"], saved["initial_eval"], saved["last_eval"], guard=guard,
                     row_offset=offset, restarts=state.restarts, shown_errors=state.shown_errors)  # fmt: skip


def recover(run: Run, state: LoopState, first: LoopState) -> LoopState:
    """After a worker died (`run` holds the rebuilt workers): the last intact checkpoint (as a resume picks it), or
    (no step directory yet) `first`, the loop state after step 0, again with the rebuilt workers' weights."""
    ckpt, why = resume_checkpoint(run.record.run_dir / "checkpoints")
    if ckpt is not None:
        if why:
            say(f"forgeweave: {why}")
        return restore(run, state, ckpt)
    run.record.truncate(0)
    if first.guard is not None:
        run.record.probe_log(list(first.guard.events))
    return dataclasses.replace(first, restarts=state.restarts, shown_errors=state.shown_errors)


def rollback_target(step: int, record: Record, guard: CollapseGuard) -> tuple[Path, CollapseGuard]:
    """The checkpoint a collapse-guard rollback (or stop) at probe step `step` restores: the best probe's when it is
    intact, else the newest intact one before it, said in one line (the guard returned then holds that one's weights
    and probe score); none intact is a UserError, and the run stops."""
    root, best = record.run_dir / "checkpoints", guard.best_step
    if not (problem := checkpoint_problem(ckpt := root / step_dir_name(best))):
        return ckpt, guard
    why = f"step {step}: collapse guard: the best probe's checkpoint {ckpt.name} {problem}"
    ckpt, line = newest_intact(root, why, upto=best - 1)
    if ckpt is None:
        raise UserError(f"{why}, and there is no checkpoint before it to roll back to: set collapse.action=warn, "
                        "then --resume")  # fmt: skip
    say(f"forgeweave: {line}")
    return ckpt, guard.holding(step, score_of(ckpt))


def collect_saved(run: Run, state: LoopState) -> LoopState:
    """Wait for the checkpoint in flight (a failed save fails the run with its error) and record it: the stall
    (what training waited for) and the total until durable; returns the state with nothing in flight."""
    if state.saving is None:
        return state
    (step, stall), start = state.saving, time.perf_counter()
    report = run.work.wait_saved()
    stall += report.stall_seconds if run.async_save else time.perf_counter() - start  # then the next optimizer
    total = stall + report.seconds if run.async_save else stall  # step may have waited for the copy
    run.record.checkpoint(step, report, stall=stall, total=total, last=step == run.sched.steps or bool(state.stopped))
    state = state.timed({"checkpoint_total": total, "checkpoint_stall": stall})
    return dataclasses.replace(state, saving=None, saved=report)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
