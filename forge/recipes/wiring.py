"""The recipe's wiring: what `forge.recipes.grpo.run` builds from the config (`RunConfig`) before its loop starts: the
run's record, the prep stage's work and the loop's context (`forge.loop.Run`). The loop and the components below it
get sections or values, never the composite; the components themselves are built by `forge.compose`.

- `RunRecord`: everything the run writes (the run directory and the tracker): claimed and locked at open,
  metrics/samples/eval/probe/ensemble reports per step, checkpoints once durable, status and summary.
- `prepare_data`: the prep stage (data/{train,eval,probe}.parquet and manifest.json).
- `loop_context`: the `Run` of a config, its workers, runner, data and record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from forge.checkpoint import SaveReport, apply_retention, export_model, has_weights, is_adapter, step_dir_name
from forge.compose import data_sources, record_changes, resume_changes
from forge.config import RunConfig, dump_yaml
from forge.data import prepare
from forge.errors import DiskFull, UserError
from forge.io import atomic_write_text, write_json
from forge.loop import Data, Limits, LoopState, Run, Schedule, say
from forge.metrics import probe_metrics
from forge.models import format_prompt_fn, load_tokenizer
from forge.records import Rollouts, ScoredBatch, UpdateStats
from forge.resume import check_resumable, checkpoint_step
from forge.rollout.base import SamplingParams
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
from forge.stages import StageRunner, Stages
from forge.tracking import JsonlTracker, MultiTracker, Tracker

if TYPE_CHECKING:
    from forge.rewards.teacher import TeacherScores


def schedule(cfg: RunConfig) -> Schedule:
    """When the run evaluates, probes and checkpoints."""
    return Schedule.of(cfg.steps, cfg.eval.every, cfg.checkpoint.every, cfg.collapse)


def loop_context(cfg: RunConfig, work: Stages, runner: StageRunner, record: RunRecord) -> Run:
    """The loop's context: the workers (recorded in workers.json and the tracker), the stage runner, the prepared
    data (read now), the record and the settings the loop reads."""
    record.started_workers(work.where())
    record.track_start()
    r = cfg.rollout
    limits = Limits(cfg.reward.max_failing_steps, cfg.update.max_skipped_steps)
    sampling = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.group_size, cfg.seed)
    return Run(work, runner, Data.read(record.run_dir), record, schedule(cfg), cfg.seed, r.prompts_per_step,
               sampling, cfg.algo.max_staleness, limits, cfg.collapse.probe_max_problems,
               cfg.checkpoint.async_save, bool(cfg.distill.teacher))  # fmt: skip


def token_decoder(cfg: RunConfig) -> Callable[[list[int]], list[str]] | None:
    """What decodes each token of a sample alone for samples.jsonl's token record: the policy's tokenizer, special
    tokens kept (the eos the policy sampled is one of its tokens). A tokenizer this process cannot load (a hub id not
    cached where the driver runs) is said once; the records then keep ids only (None)."""
    try:
        tok = load_tokenizer(cfg.model)
    except UserError as e:
        say(f"forgeweave: samples.jsonl records token ids without their text: {e}")
        return None
    return lambda ids: tok.batch_decode([[t] for t in ids], skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False)  # fmt: skip


def prepare_data(cfg: RunConfig, run_dir: Path) -> dict:
    """The prep stage: data/{train,eval,probe}.parquet and manifest.json from the configured source."""
    tok = load_tokenizer(cfg.model)
    count = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    prepared = prepare(data_sources(cfg), run_dir, format_prompt_fn(tok, cfg.model), count)
    return {"train_rows": len(prepared.train), "eval_rows": len(prepared.eval)}


class RunRecord:
    """The run directory and the tracker: every write the loop makes goes through here (rank 0 / the driver)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool, *, tracker: Tracker | None, plan: dict | None):
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
        self.status_step = 0  # the step status.json names last
        self.token_text = token_decoder(cfg)  # each sampled token's text for samples.jsonl (None: ids only)

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
        c = self.cfg
        track_run_start(self.tracker, self.run_dir, dataclasses.asdict(c), preset=c.preset, model=c.model.path)

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

    def step(self, step: int, metrics: dict, *, rows: list[dict], rollouts: Rollouts, batch: ScoredBatch,
             teacher: TeacherScores | None = None, stats: UpdateStats | None = None) -> None:  # fmt: skip
        """The step's metrics, a few samples (with their tokens, the trainer's log-prob gap per token from the update's
        `stats` and, distilling, the teacher's log-ratio: forge.rundir.append_samples), the ensemble's report on refit
        steps, status.json."""
        if batch.ensemble_report is not None:
            write_json(self.run_dir / "ensemble" / f"{step_dir_name(step)}.json", batch.ensemble_report)
        self.tracker.log_metrics(metrics, step=step)
        # the trainer's version when the rollouts were checked: the update made `policy/version`, one past it
        trainer = int(metrics["policy/version"]) - 1 if "policy/version" in metrics else None
        written = append_samples(self.run_dir, step, rows, rollouts, batch, trainer_version=trainer,
                                 token_text=self.token_text, teacher=teacher,
                                 gaps=stats.logprob_gaps if stats is not None else ())  # fmt: skip
        self.tracker.log_table("samples", step, written)
        self.status("running", step)

    def checkpoint(self, step: int, report: SaveReport, *, stall: float, total: float, last: bool) -> None:
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
        wall, c = time.perf_counter() - self.started, self.cfg
        summary = {**run_summary(self.run_dir, state, wall, preset=c.preset, model=c.model.path), **extra}
        summary.update(self.tracker.info())  # e.g. mlflow_run_id
        write_json(self.run_dir / "summary.json", summary)
        self.tracker.log_artifact(self.run_dir / "summary.json")
        self.status("finished", state.step)
        self.tracker.finish("FINISHED")
        return summary
