"""The bookkeeping around the GRPO loop (`forge.recipes.grpo`), in small named parts that know nothing of the math:

- `Schedule`: which steps evaluate, probe and checkpoint, written once from the config.
- `LoopState`: what the loop carries from step to step and saves with a checkpoint (a frozen record: the loop
  replaces it, nothing mutates it behind the loop's back).
- `verifier_streaks`, `update_streak` + `stop_reason`: the stop rules (a verifier failing on every item,
  non-finite updates), as pure functions that return a new state or a reason instead of raising.
- `Data`: the prepared splits and the prompt sampler; `prepare_data` is the prep stage's work.
- `restore` / `recover`: the loop state back from a checkpoint (resume, a rollback, a worker lost); a damaged or
  missing checkpoint is never restored: `recover` falls back to the newest intact one and `rollback_target` to the
  newest intact one before the best probe's, with one line saying so (`forge.checkpoint.resume_checkpoint` /
  `newest_intact`), or the run stops with one line.
- `collect_saved`: waits for the checkpoint in flight and records it (at most one is in flight).
- `RunRecord`: everything the run writes (the run directory and the tracker): claimed and locked at open,
  metrics/samples/eval/probe/ensemble reports per step, checkpoints once durable, status and summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from forge.checkpoint import (
    SaveReport,
    apply_retention,
    checkpoint_problem,
    export_model,
    has_weights,
    is_adapter,
    load_state,
    newest_intact,
    remove_partial,
    resume_checkpoint,
    score_of,
    step_dir_name,
)
from forge.config import RunConfig, dump_yaml
from forge.data import PromptSampler, check_data_hash, prepare, read_probe, read_split
from forge.errors import DiskFull, UserError
from forge.guard import CollapseGuard
from forge.io import atomic_write_text, write_json
from forge.metrics import error_line, probe_metrics
from forge.models import format_prompt_fn, load_tokenizer
from forge.records import Rollouts, ScoredBatch, UpdateStats
from forge.resume import check_resumable, checkpoint_step, record_changes, resume_changes
from forge.rundir import (
    RunLock,
    append_samples,
    claim_run_dir,
    run_summary,
    track_run_start,
    truncate_samples,
    write_guard_log,
    write_status,
)
from forge.tracking import JsonlTracker, MultiTracker, Tracker

if TYPE_CHECKING:
    from forge.stages import Stages


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
    def of(cls, cfg: RunConfig) -> Schedule:
        c = cfg.collapse
        probed = bool(c.probe_source)
        restores = probed and c.action in ("stop", "rollback")
        probe_every = (c.probe_every or cfg.eval.every) if probed else 0
        return cls(cfg.steps, cfg.eval.every, cfg.checkpoint.every, probe_every, restores)

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
    """What the loop carries between steps; `payload` is the part a checkpoint saves (with `step`)."""

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

    def timed(self, laps: dict[str, float]) -> LoopState:
        seconds = dict(self.seconds)
        for k, v in laps.items():
            seconds[k] = seconds.get(k, 0.0) + v
        return dataclasses.replace(self, seconds=seconds)

    def payload(self) -> dict:
        return {"seconds": dict(self.seconds), "initial_eval": self.initial_eval, "last_eval": self.last_eval}

    @classmethod
    def restored(cls, saved: dict) -> LoopState:
        return cls(saved["step"], saved["seconds"], saved["initial_eval"], saved["last_eval"])


def verifier_streaks(state: LoopState, batch: ScoredBatch) -> LoopState:
    """Per verifier, the steps in a row on which it erred on every item (raised, or returned something that is not a
    score; None is not an error), this step's scores counted."""
    n = batch.scores.shape[0]
    failing = {v: state.failing.get(v, 0) + 1 if n and batch.verifier_errored.get(v, 0) == n else 0
               for v in batch.verifier_names}  # fmt: skip
    return dataclasses.replace(state, failing=failing)


def environment_streak(state: LoopState, rollouts: Rollouts) -> LoopState:
    """Steps in a row on which the environment failed every episode (an OpenEnv server gone), this step counted."""
    failures = rollouts.episodes.failures if rollouts.episodes is not None else []
    if failures and all(failures):
        return dataclasses.replace(state, env_failing=state.env_failing + 1, env_error=failures[0])
    return dataclasses.replace(state, env_failing=0, env_error="")


def update_streak(state: LoopState, stats: UpdateStats) -> LoopState:
    """Updates skipped in a row for a non-finite loss or gradient norm, this step's counted."""
    return dataclasses.replace(state, skipped=state.skipped + 1 if stats.skipped else 0)


def stop_reason(state: LoopState, batch: ScoredBatch, cfg: RunConfig) -> str:
    """Why the run must stop after this step ("" = it goes on): a verifier that failed on every item for
    reward.max_failing_steps steps (training on the zeros it leaves would teach nothing), an environment that failed
    every episode for as many, or update.max_skipped_steps non-finite updates in a row (the weights are still the
    last finite ones, as is every checkpoint)."""
    limit = cfg.reward.max_failing_steps
    if limit and state.env_failing >= limit:
        return (f"step {state.step}: the environment failed every episode for {state.env_failing} steps in a row "
                f"(reward.max_failing_steps={limit}): {error_line(state.env_error)}; bring the environment server "
                "back, then --resume")  # fmt: skip
    for name, count in state.failing.items():
        if limit and count >= limit:
            return (f"step {state.step}: verifier '{name}' failed on every item for {count} steps in a row "
                    f"(reward.max_failing_steps={limit}): {error_line(batch.verifier_errors.get(name, ''))}; fix the "
                    "verifier (or set reward.max_failing_steps=0), then --resume")  # fmt: skip
    if state.skipped >= (cap := cfg.update.max_skipped_steps):
        return (f"step {state.step}: {cap} updates in a row had a non-finite loss or gradient norm and were skipped "
                f"(update.max_skipped_steps={cap}); check the rewards and lower update.lr, then --resume")  # fmt: skip
    return ""


class RunRecord:
    """The run directory and the tracker: every write the loop makes goes through here (rank 0 / the driver)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool, tracker: Tracker | None, plan: dict | None):
        """Claim the run directory (new, or existing with resume), lock it, write config.yaml (or record a resume's
        changes) and plan.json. A refused resume leaves the directory exactly as it was."""
        self.cfg, self.run_dir, self.started = cfg, run_dir, time.perf_counter()
        claim_run_dir(run_dir, resume)
        self.resume_from = check_resumable(run_dir) if resume else None  # None: no checkpoint yet
        changes = resume_changes(run_dir, cfg, self.resume_from) if resume else {}  # refused ones raise here
        self.lock = RunLock.acquire(run_dir)  # one process per run directory; released when the run is over
        with contextlib.ExitStack() as on_error:
            on_error.callback(self.lock.release)
            if not resume:  # first: with config.yaml a run killed at any later moment can be resumed
                atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
            elif changes:  # config.yaml := the resumed config; config_changes.jsonl says what changed, from when
                record_changes(run_dir, cfg, changes, checkpoint_step(self.resume_from))
            if plan is not None:
                write_json(run_dir / "plan.json", plan)
            on_error.pop_all()
        self.jsonl = JsonlTracker(run_dir)
        self.tracker: Tracker = MultiTracker(self.jsonl, tracker) if tracker else self.jsonl
        self.shown_errors: set[tuple[str, str]] = set()  # (verifier, error text) already printed
        self.status_step = 0  # the step status.json names last

    @contextlib.contextmanager
    def failed_on_error(self):
        """Mark the run failed (status.json, tracker) if anything below raises; never swallow the error; release
        the lock at the end whatever happens."""
        try:
            yield
        except BaseException as e:
            with contextlib.suppress(OSError, DiskFull):  # a full disk must not hide the error that stopped the run
                write_status(self.run_dir, "failed", step=self.status_step, error=f"{type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                self.tracker.finish("FAILED")
            raise
        finally:
            self.lock.release()

    def status(self, state: str, step: int) -> None:
        self.status_step = step
        write_status(self.run_dir, state, step=step)

    def started_workers(self, where: dict) -> None:
        write_json(self.run_dir / "workers.json", where)

    def fresh(self) -> None:
        """A fresh start (or a redone prepare): nothing recorded yet."""
        self.truncate(-1)
        write_guard_log(self.run_dir, [])

    def truncate(self, step: int) -> None:
        """Forget what was recorded after `step` (the steps a resume or recovery redoes)."""
        self.jsonl.truncate_after(step)
        truncate_samples(self.run_dir, step)

    def track_start(self) -> None:
        track_run_start(self.tracker, self.cfg, self.run_dir)

    def eval_report(self, report: dict, probe: bool = False) -> None:
        """eval/step-NNNNNN.json (or eval/probe-step-NNNNNN.json), logged as an artifact."""
        name = f"probe-{step_dir_name(report['step'])}" if probe else step_dir_name(report["step"])
        write_json(path := self.run_dir / "eval" / f"{name}.json", report)
        self.tracker.log_artifact(path, "eval")

    def log(self, metrics: dict, step: int) -> None:
        self.tracker.log_metrics(metrics, step=step)

    def probe(self, step: int, report: dict, guard_metrics: dict, events: list[dict]) -> None:
        self.tracker.log_metrics({**probe_metrics(report), **guard_metrics}, step=step)
        self.probe_log(events)

    def probe_log(self, events: list[dict]) -> None:
        """guard.jsonl := the collapse guard's firings so far."""
        write_guard_log(self.run_dir, events)

    def step(self, step: int, metrics: dict, rows: list[dict], rollouts: Rollouts, batch: ScoredBatch) -> None:
        """The step's metrics, a few samples, the ensemble's report on refit steps, status.json."""
        if batch.ensemble_report is not None:
            write_json(self.run_dir / "ensemble" / f"{step_dir_name(step)}.json", batch.ensemble_report)
        self.tracker.log_metrics(metrics, step=step)
        self.tracker.log_table("samples", step, append_samples(self.run_dir, step, rows, rollouts, batch))
        self.status("running", step)

    def checkpoint(self, step: int, report: SaveReport, stall: float, total: float, last: bool) -> None:
        """A durable checkpoint as a second metrics row of its step; the run's final model exported as an HF
        directory if it was sharded; registered with the tracker; retention applied."""
        self.tracker.log_metrics(
            {"time/checkpoint_s": total, "time/checkpoint_stall_s": stall, "checkpoint/bytes": float(report.bytes)},
            step=step,
        )
        final = Path(report.path)
        if last and not has_weights(final) and not is_adapter(final):  # a LoRA run: `export`
            export_model(final)
        self.tracker.register_checkpoint(final, step, report.eval_score)
        c = self.cfg.checkpoint
        apply_retention(self.run_dir / "checkpoints", c.keep_last, c.keep_best)

    def finish(self, state: LoopState, extra: dict) -> dict:
        """summary.json (with `extra`, e.g. the Prefect flow-run id), status finished; returns the summary."""
        summary = {**run_summary(self.cfg, self.run_dir, state, time.perf_counter() - self.started), **extra}
        summary.update(self.tracker.info())  # e.g. mlflow_run_id
        write_json(self.run_dir / "summary.json", summary)
        self.tracker.log_artifact(self.run_dir / "summary.json")
        self.status("finished", state.step)
        self.tracker.finish("FINISHED")
        return summary


@dataclass
class Data:
    """The prepared splits (checked against the manifest's hash) and the training prompt sampler."""

    train: list[dict]
    eval: list[dict]
    probe: list[dict] | None
    hash: str
    sampler: PromptSampler

    @classmethod
    def read(cls, cfg: RunConfig, run_dir: Path) -> Data:
        train, eval_, probe = read_split(run_dir, "train"), read_split(run_dir, "eval"), read_probe(run_dir)
        digest = check_data_hash(run_dir, train, eval_, probe=probe)
        return cls(train, eval_, probe, digest, PromptSampler(train, seed=cfg.seed))


def prepare_data(cfg: RunConfig, run_dir: Path) -> dict:
    """The prep stage: data/{train,eval,probe}.parquet and manifest.json from the configured source."""
    tok = load_tokenizer(cfg.model)
    count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    prepared = prepare(cfg, run_dir, format_prompt_fn(tok, cfg.model), count)
    return {"train_rows": len(prepared.train), "eval_rows": len(prepared.eval)}


def restore(ckpt: Path, work: Stages, data: Data, record: RunRecord, guard: CollapseGuard | None) -> LoopState:
    """Resume from checkpoint `ckpt`: the workers' state, the data cursor, the guard; what was recorded after it is
    cut (those steps are redone)."""
    remove_partial(ckpt.parent)  # what a killed save left behind (no save is in flight now)
    saved = load_state(ckpt)
    check_data_hash(record.run_dir, data.train, data.eval, saved.get("data_hash"), data.probe)
    work.restore(ckpt, saved.get("aggregator"))
    data.sampler.load_state_dict(saved["sampler"])
    record.truncate(saved["step"])
    if guard is not None:
        guard.load_state_dict(saved.get("guard"))
        record.probe_log(guard.events)  # firings after the checkpoint are redone
    record.status("running", saved["step"])
    return LoopState.restored(saved)


def recover(first: tuple[LoopState, dict | None], work: Stages, data: Data, record: RunRecord,
            guard: CollapseGuard | None) -> LoopState:  # fmt: skip
    """After a worker died: the last intact checkpoint (as a resume picks it), or (no step directory yet) step 0
    again with the rebuilt workers' weights; `first`: the loop state and the guard's state after step 0."""
    ckpt, why = resume_checkpoint(record.run_dir / "checkpoints")
    if ckpt is not None:
        if why:
            say(f"forgeweave: {why}")
        return restore(ckpt, work, data, record, guard)
    data.sampler = PromptSampler(data.train, seed=record.cfg.seed)
    record.truncate(0)
    first_state, first_guard = first
    if guard is not None:
        guard.load_state_dict(first_guard)
        record.probe_log(guard.events)
    return first_state


def rollback_target(step: int, record: RunRecord, guard: CollapseGuard) -> Path:
    """The checkpoint a collapse-guard rollback (or stop) at probe step `step` restores: the best probe's when it is
    intact, else the newest intact one before it, said in one line (the guard then holds that one's weights and
    probe score); none intact is a UserError, and the run stops."""
    root, best = record.run_dir / "checkpoints", guard.best_step
    if not (problem := checkpoint_problem(ckpt := root / step_dir_name(best))):
        return ckpt
    why = f"step {step}: collapse guard: the best probe's checkpoint {ckpt.name} {problem}"
    ckpt, line = newest_intact(root, why, upto=best - 1)
    if ckpt is None:
        raise UserError(f"{why}, and there is no checkpoint before it to roll back to: set collapse.action=warn, "
                        "then --resume")  # fmt: skip
    say(f"forgeweave: {line}")
    guard.holding(step, score_of(ckpt))
    return ckpt


def collect_saved(state: LoopState, work: Stages, record: RunRecord) -> LoopState:
    """Wait for the checkpoint in flight (a failed save fails the run with its error) and record it: the stall
    (what training waited for) and the total until durable; returns the state with nothing in flight."""
    if state.saving is None:
        return state
    (step, stall), start = state.saving, time.perf_counter()
    report = work.wait_saved()
    background = record.cfg.checkpoint.async_save  # then the next optimizer step may have waited for the copy
    stall += report.stall_seconds if background else time.perf_counter() - start
    total = stall + report.seconds if background else stall
    record.checkpoint(step, report, stall, total, last=step == record.cfg.steps or bool(state.stopped))
    state = state.timed({"checkpoint_total": total, "checkpoint_stall": stall})
    return dataclasses.replace(state, saving=None, saved=report)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
