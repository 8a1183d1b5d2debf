"""GRPO, top to bottom: prep → [rollout → reward → advantages → update → (evaluate, checkpoint)] × steps.

`run(cfg, run_dir)` is the only step loop in forgeweave. It calls every stage through one seam
(`forge.stages`): `runner(stage, step, fn, *args)`, where `fn` is a method of a `Stages` object. Plain mode
calls the function, the Prefect flow makes each call a task run, and the Ray adapter supplies `Stages` whose
methods are calls on long-lived actors that Weaver placed; the loop is the same. Variants (Dr. GRPO, DAPO, GSPO,
CISPO, RLOO advantages) are config choices of the components (`forge.losses`, `forge.advantages`).

Departures from textbook GRPO (DeepSeekMath, Shao et al. 2024) live in the components and are config: token-level
loss normalisation by default (`algo.loss_type`), no KL term unless `algo.beta` > 0, an adaptive LR controller
(`update.adaptive.enabled`), and optionally off-policy batches (asynchronous, below) with truncated importance weights.

Asynchronous GRPO (`algo.max_staleness` = k >= 1, Ray actors): the rollouts of steps t+1..t+k are started before
the update of step t, so sampling overlaps the update; the rollout of step t+k samples from the weights of step
t-1, at most k versions behind the trainer (checked each step), and `algo.is_correction=tis` reweights the loss for
it (`forge.losses`). The schedule is fixed, not timing-dependent, and no rollout starts past the next checkpoint
(in-flight work is drained there): a run gives the same result however fast its actors are, and resumes exactly.
k = 0 is the synchronous loop: rollout, reward and update take turns.

Collapse guard (`collapse.probe_source`): pass@1 on a labelled probe set the reward never sees, at step 0 and every
`collapse.probe_every` steps; when it fell while reward/mean rose (`forge.guard`) the run warns, rolls back to the
best-probe checkpoint and goes on with new prompts, or stops with its weights (`collapse.action`).

Faults: a `WorkerLost` (an actor died) rebuilds the stages and continues from the last checkpoint (or from the
start when there is none yet), up to `orchestration.max_restarts` times; the steps redone are cut from
metrics.jsonl/samples.jsonl first, so no step is lost or recorded twice.

Run directory (the contract other tools read): config.yaml (the current config: a resume may change it, each
change a line of config_changes.jsonl), plan.json, status.json, data/{train,eval,probe}.parquet,
data/manifest.json, metrics.jsonl, samples.jsonl, eval/step-NNNNNN.json, eval/probe-step-NNNNNN.json,
checkpoints/step-NNNNNN/ + checkpoints/latest, ensemble/step-NNNNNN.json (label-free refits), guard.jsonl (collapse
guard firings), workers.json (where every stage ran), inputs/ (datasets given to forge.train as objects) and
summary.json only once the run has finished.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.checkpoint import (
    SaveReport,
    apply_retention,
    export_model,
    has_weights,
    is_adapter,
    latest_checkpoint,
    load_state,
    remove_partial,
    set_rng_state,
    step_dir_name,
)
from forge.config import RunConfig, dump_yaml
from forge.data import PromptSampler, check_data_hash, prepare, read_probe, read_split
from forge.errors import UserError
from forge.guard import CollapseGuard
from forge.io import atomic_write_text, write_json
from forge.metrics import (
    Stopwatch,
    checked_staleness,
    eval_metrics,
    failing_in_a_row,
    overlap_metrics,
    probe_metrics,
    show_verifier_errors,
    skipped_in_a_row,
    step_metrics,
)
from forge.models import format_prompt_fn, load_tokenizer
from forge.records import Rollouts, Scored, UpdateStats
from forge.resume import check_resumable, checkpoint_step, record_changes, resume_changes
from forge.rollout import SamplingParams
from forge.rundir import (
    RunLock,
    append_samples,
    claim_run_dir,
    progress_bar,
    run_summary,
    track_run_start,
    truncate_samples,
    update_bar,
    write_guard_log,
    write_status,
)
from forge.stages import LocalStages, StageRunner, Stages, StagesFactory, WorkerLost, call_stage
from forge.tracking import JsonlTracker, MultiTracker, Tracker

STAGES = ("rollout", "reward", "update", "evaluate", "checkpoint")


@dataclass
class RunState:
    """Everything the loop carries between steps (and restores on resume)."""

    step: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    initial_eval: dict | None = None
    last_eval: dict | None = None


def run(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool = False,
    tracker: Tracker | None = None,
    progress: bool = True,
    plan: dict | None = None,
    stages: StagesFactory = LocalStages,
    runner: StageRunner = call_stage,
    **summary_extra,
) -> dict:
    """Train with GRPO and return summary.json's content. Raises UserError for problems a user can fix.

    `stages(cfg, run_dir, plan)` builds the workers (in-process by default); `runner` runs each stage call."""
    grpo = GRPORun(cfg, Path(run_dir), stages, resume=resume, tracker=tracker, plan=plan)
    with grpo.failure_guard():
        runner("prepare", 0, grpo.setup)
        bar = progress_bar(cfg.steps, grpo.state.step, progress)
        while grpo.state.step < cfg.steps and not grpo.stopped:
            try:
                for step in grpo.remaining_steps():
                    s, clock = grpo.stages, Stopwatch()
                    rows, started = grpo.start_rollouts(step)  # B prompts; this step's and up to k steps ahead
                    with clock("rollout"):  # 1. G samples for each of B prompts, from a policy <= k versions old
                        rollouts: Rollouts = runner("rollout", step, s.rollout, started)
                    staleness = grpo.check_staleness(step, rollouts)
                    with clock("reward"):  # 2. verifiers -> weighted reward -> group-relative advantages
                        scored: Scored = runner("reward", step, s.reward, started)
                    grpo.check_verifiers(step, scored)  # errors shown; failing on every item too long stops the run
                    with clock("update"):  # 3. log-probs -> (IS-weighted) ratio/loss -> backward -> step; weights
                        stats: UpdateStats = runner("update", step, s.update, scored.batch)
                    grpo.check_skipped(step, stats)  # a non-finite step was skipped: stop after too many in a row
                    report = None
                    if grpo.eval_due(step):  # 4. held-out pass@1 on schedule
                        with clock("evaluate"):
                            report = runner("evaluate", step, grpo.evaluate, step)
                    metrics = grpo.end_step(step, rows, scored, stats, report, clock, staleness)  # 5. metrics
                    if grpo.probe_due(step):  # labelled probe -> collapse guard: warn, roll back or stop (forge.guard)
                        grpo.after_probe(step, runner("probe", step, grpo.probe, step))
                    if grpo.checkpoint_due(step):  # 6. weights, optimizer, data cursor, RNG, atomically
                        with clock("checkpoint"):
                            runner("checkpoint", step, grpo.checkpoint, step)
                        grpo.add_seconds({"checkpoint": clock.laps["checkpoint"]})
                    update_bar(bar, metrics, grpo.state.last_eval)
                    if grpo.stopped:  # by the collapse guard, with the best probe's weights (summary.json says why)
                        break
            except WorkerLost as lost:
                grpo.recover(lost)  # rebuild the workers, continue from the last checkpoint (or re-raise)
        if bar is not None:
            bar.close()
        return grpo.finish(**summary_extra)


class GRPORun:
    """The bookkeeping around the loop: run directory, data, sampler, metrics, checkpoints, recovery."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        make_stages: StagesFactory = LocalStages,
        resume: bool = False,
        tracker: Tracker | None = None,
        plan: dict | None = None,
    ):
        """Claim the run directory (new, or existing with resume); `plan` (Weaver's) is saved as plan.json."""
        self.cfg = cfg.validate()
        self.run_dir = run_dir
        self.make_stages = make_stages
        self.resume = resume
        self.plan = plan
        self.started = time.perf_counter()
        self.restarts = 0
        self.skipped_in_a_row = 0
        self.failing_in_a_row: dict[str, int] = {}  # verifier -> steps in a row it erred on every item
        self.shown_errors: set[tuple[str, str]] = set()  # (verifier, error text) already printed
        claim_run_dir(run_dir, resume)
        # read-only checks first: a refused resume leaves the directory exactly as it was; None = no checkpoint yet
        self.resume_from = check_resumable(run_dir) if resume else None
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
        self.state = RunState()
        self.stages: Stages | None = None
        self.in_flight: dict[int, tuple[list[dict], Any]] = {}  # step -> (rows, handle) of started rollouts
        self.saving: tuple[int, float] | None = None  # the checkpoint in flight: (step, seconds the loop waited)
        self.last_saved: SaveReport | None = None
        self.guard = CollapseGuard.for_run(cfg.collapse) if cfg.collapse.probe_source else None  # + state after step 0:
        self.first_guard, self.stopped = None, ""  # stopped: why the collapse guard ended the run early
        self.restores = self.guard is not None and cfg.collapse.action in ("stop", "rollback")
        self.probe_every = cfg.collapse.probe_every or cfg.eval.every

    @contextlib.contextmanager
    def failure_guard(self):
        """Mark the run failed (status.json, tracker) if anything below raises; never swallow the error."""
        try:
            yield
        except BaseException as e:
            with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped the run
                write_status(self.run_dir, "failed", step=self.state.step, error=f"{type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                self.tracker.finish("FAILED")
            raise
        finally:  # also on Ctrl-C / SIGTERM (the CLI turns it into SystemExit): no process outlives the run
            self.close()
            self.lock.release()

    def close(self) -> None:
        """Stop the workers (actors, engines); safe to call twice."""
        if self.stages is not None:
            self.stages.close()
            self.stages = None

    def setup(self) -> dict:
        """Prep stage (unless resuming), the workers, then restore (resume) or the initial evaluation."""
        cfg, run_dir = self.cfg, self.run_dir
        self.resume = self.resume and self.resume_from is not None  # stopped before a first checkpoint: from 0
        if not self.resume:  # a fresh start (or a retried prepare): nothing recorded yet
            self.jsonl.truncate_after(-1)
            truncate_samples(run_dir, -1)
            write_guard_log(run_dir, [])
            tok = load_tokenizer(cfg.model)
            prepare(
                cfg,
                run_dir,
                format_prompt_fn(tok, cfg.model),
                lambda s: len(tok(s, add_special_tokens=False).input_ids),
            )
        self.train_rows, self.eval_rows = read_split(run_dir, "train"), read_split(run_dir, "eval")
        self.probe_rows = read_probe(run_dir)
        self.data_hash = check_data_hash(run_dir, self.train_rows, self.eval_rows, probe=self.probe_rows)
        self.sampler = PromptSampler(self.train_rows, seed=cfg.seed)
        self.close()  # a retried prepare: the workers of the failed attempt are stopped, not leaked
        self.stages = self.make_stages(cfg, run_dir, self.plan)
        write_json(run_dir / "workers.json", self.stages.where())
        track_run_start(self.tracker, cfg, run_dir)
        if self.resume:
            self._restore()
        else:
            self.state.initial_eval = self.state.last_eval = self._eval_report(0)
            self.state.seconds["evaluate"] += self.state.initial_eval["seconds"]
            self.tracker.log_metrics(eval_metrics(self.state.initial_eval), step=0)
            if self.guard is not None:  # the guard's first best; a rollback to it needs a checkpoint
                self.after_probe(0, self.probe(0))
                self.first_guard = self.guard.state_dict()
                if self.restores:
                    self.checkpoint(0)
        write_status(run_dir, "running", step=self.state.step)
        return {"train_rows": len(self.train_rows), "eval_rows": len(self.eval_rows), "start_step": self.state.step}

    def remaining_steps(self) -> range:
        return range(self.state.step + 1, self.cfg.steps + 1)

    def next_batch(self) -> tuple[list[dict], list[str], SamplingParams]:
        """The step's prompt rows, their model inputs, and sampling settings."""
        r = self.cfg.rollout
        rows = self.sampler.next_batch(r.prompts_per_step)
        params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, n=r.group_size)
        return rows, [row["model_input"] for row in rows], params

    def start_rollouts(self, step: int) -> tuple[list[dict], Any]:
        """Start the rollouts of `step` and of up to algo.max_staleness later steps, each from the policy the
        trainer holds now; returns `step`'s rows and handle. None starts past the next checkpoint: in-flight work is
        drained there, so a run resumed from it goes on exactly as the uninterrupted run did."""
        last = min(step + self.cfg.algo.max_staleness, self.next_checkpoint(step))
        for ahead in range(step, last + 1):
            if ahead not in self.in_flight:
                rows, prompts, params = self.next_batch()
                self.in_flight[ahead] = (rows, self.stages.start(rows, prompts, params, ahead))
        return self.in_flight.pop(step)

    def check_staleness(self, step: int, rollouts: Rollouts) -> int:
        """Policy versions between the sampler and the trainer (0 on-policy); never above algo.max_staleness."""
        return checked_staleness(step, self.stages.policy_version, rollouts.policy_version, self.cfg.algo.max_staleness)

    def check_verifiers(self, step: int, scored: Scored) -> None:
        """Print each verifier error text once (stderr); reward.max_failing_steps steps in a row on which a
        verifier erred on every item stop the run with its error."""
        show_verifier_errors(scored.batch, step, self.shown_errors)
        limit = self.cfg.reward.max_failing_steps
        self.failing_in_a_row = failing_in_a_row(self.failing_in_a_row, scored.batch, step, limit)

    def check_skipped(self, step: int, stats: UpdateStats) -> None:
        """Updates skipped in a row for a non-finite loss/gradient; update.max_skipped_steps of them stop the run."""
        self.skipped_in_a_row = skipped_in_a_row(self.skipped_in_a_row, stats, step, self.cfg.update.max_skipped_steps)

    def eval_due(self, step: int) -> bool:
        return _due(step, self.cfg.eval.every, self.cfg.steps)

    def evaluate(self, step: int) -> dict:
        report = self._eval_report(step)
        self.state.last_eval = report
        return report

    def probe_due(self, step: int) -> bool:
        return self.guard is not None and _due(step, self.probe_every, self.cfg.steps)

    def probe(self, step: int) -> dict:
        """Greedy pass@1 on the probe rows (measures only: safe to repeat); eval/probe-step-NNNNNN.json."""
        report = self.stages.evaluate(self.probe_rows[: self.cfg.collapse.probe_max_problems], step, True)
        write_json(path := self.run_dir / "eval" / f"probe-{step_dir_name(step)}.json", report)
        self.tracker.log_artifact(path, "eval")
        return report

    def after_probe(self, step: int, report: dict) -> None:
        """The guard decides; `probe/*`, `guard/*` metrics; a firing: stderr, guard.jsonl, maybe a restore."""
        event = self.guard.probe(step, report["pass@1"])
        self.add_seconds({"probe": report["seconds"]})
        if event is not None:
            print(event.line(), file=sys.stderr, flush=True)
            write_guard_log(self.run_dir, self.guard.events)
            if event.action in ("rollback", "stop"):
                self._restore_best()
            self.stopped = event.line().removeprefix("forgeweave: ") if event.action == "stop" else ""
        self.tracker.log_metrics({**probe_metrics(report), **self.guard.metrics(event)}, step=step)

    def end_step(
        self, step: int, rows: list[dict], scored: Scored, stats: UpdateStats, report: dict | None,
        clock: Stopwatch, staleness: int,
    ) -> dict[str, float]:  # fmt: skip
        """Log the step's metrics and samples; returns the metrics."""
        batch, times = scored.batch, clock.laps
        metrics = step_metrics(batch.rollouts, batch, stats, times)
        metrics["perf/weight_sync_s"] = stats.sync_seconds  # new weights -> rollout workers; part of time/update_s
        metrics.update(overlap_metrics(batch.rollouts, stats, clock.elapsed(), staleness))
        if report is not None:
            metrics.update(eval_metrics(report))
        if scored.ensemble_report is not None:
            from forge.rewards.aggregate import report_metrics

            metrics.update(report_metrics(scored.ensemble_report))
            write_json(self.run_dir / "ensemble" / f"{step_dir_name(step)}.json", scored.ensemble_report)
        self.add_seconds(times)
        self.state.step = step
        if self.guard is not None:
            self.guard.observe(step, metrics["reward/mean"])
        self.tracker.log_metrics(metrics, step=step)
        self.tracker.log_table("samples", step, append_samples(self.run_dir, step, rows, batch))
        write_status(self.run_dir, "running", step=step)
        return metrics

    def add_seconds(self, times: dict[str, float]) -> None:
        for k, v in times.items():
            self.state.seconds[k] = self.state.seconds.get(k, 0.0) + v

    def checkpoint_due(self, step: int) -> bool:
        """On schedule and at the last step; also at every probe step when the guard may restore one."""
        return _due(step, self.cfg.checkpoint.every, self.cfg.steps) or (self.restores and self.probe_due(step))

    def next_checkpoint(self, step: int) -> int:
        """The first checkpoint step at or after `step` (`checkpoint_due`'s next)."""
        every = [e for e in (self.cfg.checkpoint.every, self.probe_every if self.restores else 0) if e > 0]
        return min([self.cfg.steps, *(-(-step // e) * e for e in every)])

    def checkpoint(self, step: int) -> None:
        """Start checkpoint `step` once the previous one is durable (at most one in flight); written in the
        background (`checkpoint.async_save`) or waited for here. `collect_saved` records it when it is done."""
        start = time.perf_counter()
        self.collect_saved()
        payload = {
            "sampler": self.sampler.state_dict(),
            "rollout_rng": self.stages.rollout_rng(),
            "seconds": dict(self.state.seconds),
            "initial_eval": self.state.initial_eval,
            "last_eval": self.state.last_eval,
            "aggregator": self.stages.reward_state(),
            "data_hash": self.data_hash,
            "guard": self.guard.state_dict() if self.guard is not None else None,
        }
        last = self.state.last_eval
        score = last["pass@1"] if last and last.get("step") == step else None
        score = self.guard.score_at(step) if self.guard else score  # retention: the best by probe pass@1 if probed
        self.stages.save(self.run_dir / "checkpoints", step, payload, score)
        self.saving = (step, time.perf_counter() - start)
        if not self.cfg.checkpoint.async_save:
            self.collect_saved()

    def collect_saved(self) -> None:
        """Wait for the checkpoint in flight (a failed save fails the run with its error), then record it as a
        second metrics row of its step: `time/checkpoint_stall_s` (what training waited for it), `time/checkpoint_s`
        (until it was durable: the stall plus the background write) and `checkpoint/bytes`; export the HF weights
        of the run's last checkpoint if they are sharded; register it; apply retention."""
        if self.saving is None:
            return
        (step, stall), start = self.saving, time.perf_counter()
        report = self.stages.wait_saved()
        self.saving = None
        background = self.cfg.checkpoint.async_save  # then the next optimizer step may have waited for the copy
        stall += report.stall_seconds if background else time.perf_counter() - start
        total = stall + report.seconds if background else stall
        self.tracker.log_metrics(
            {"time/checkpoint_s": total, "time/checkpoint_stall_s": stall, "checkpoint/bytes": float(report.bytes)},
            step=step,
        )
        self.add_seconds({"checkpoint_total": total, "checkpoint_stall": stall})
        self.last_saved = report
        final, last = Path(report.path), step == self.cfg.steps or self.stopped
        if last and not has_weights(final) and not is_adapter(final):  # a LoRA run: `export`
            export_model(final)  # sharded by several ranks: the run's final model as an HF directory
        self.tracker.register_checkpoint(Path(report.path), step, report.eval_score)
        apply_retention(self.run_dir / "checkpoints", self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_best)

    def recover(self, lost: WorkerLost) -> None:
        """After a worker died: rebuild the stages and continue from the last checkpoint (or from the start)."""
        self.restarts += 1
        self.saving = None  # a save in flight died with its workers; `latest` names the last complete one
        if self.restarts > self.cfg.orchestration.max_restarts:
            raise UserError(
                f"{lost} (after {self.restarts - 1} restarts; orchestration.max_restarts="
                f"{self.cfg.orchestration.max_restarts}); continue with --resume"
            ) from lost
        print(f"forgeweave: {lost}; restarting the workers ({self.restarts}/{self.cfg.orchestration.max_restarts})",
              file=sys.stderr, flush=True)  # fmt: skip
        self.close()
        self.in_flight = {}  # started on the dead workers; the sampler goes back to the checkpoint's cursor below
        self.stopped = ""  # the steps after the checkpoint are redone: the guard decides again
        self.stages = self.make_stages(self.cfg, self.run_dir, self.plan)
        write_json(self.run_dir / "workers.json", self.stages.where())
        if latest_checkpoint(self.run_dir / "checkpoints") is not None:
            self._restore()
        else:  # nothing saved yet: the rebuilt workers hold the initial weights; redo every step
            self.sampler = PromptSampler(self.train_rows, seed=self.cfg.seed)
            first = self.state.initial_eval
            self.state = RunState(initial_eval=first, last_eval=first)
            self.state.seconds["evaluate"] = first["seconds"]
            self.jsonl.truncate_after(0)
            truncate_samples(self.run_dir, 0)
            if self.guard is not None:
                self.guard.load_state_dict(self.first_guard)
                write_guard_log(self.run_dir, self.guard.events)

    def finish(self, **extra) -> dict:
        """Wait for the checkpoint in flight; write summary.json (extra keys, e.g. the Prefect flow-run id, are
        added to it) and mark finished."""
        self.collect_saved()
        summary = {**run_summary(self.cfg, self.run_dir, self.state, time.perf_counter() - self.started), **extra}
        summary["restarts"] = self.restarts
        if self.guard is not None:  # probe figures; after a stop, why and whose weights the final checkpoint holds
            summary.update(self.guard.summary(self.stopped))
        if self.last_saved is not None:
            summary["checkpoint"] = {"async_save": self.cfg.checkpoint.async_save, "bytes": self.last_saved.bytes,
                                     "last": Path(self.last_saved.path).name}  # fmt: skip
        summary.update(self.tracker.info())  # e.g. mlflow_run_id
        write_json(self.run_dir / "summary.json", summary)
        self.tracker.log_artifact(self.run_dir / "summary.json")
        write_status(self.run_dir, "finished", step=self.state.step)
        self.tracker.finish("FINISHED")
        return summary

    def _eval_report(self, step: int) -> dict:
        report = self.stages.evaluate(self.eval_rows, step)
        path = self.run_dir / "eval" / f"{step_dir_name(step)}.json"
        write_json(path, report)
        self.tracker.log_artifact(path, "eval")
        return report

    def _restore_best(self) -> None:
        """The best probe's weights, optimizer, reward state (and eval); new prompts and rollout RNG go on."""
        self.collect_saved()  # it may still be in flight; retention keeps it (the best by probe pass@1)
        saved = load_state(ckpt := self.run_dir / "checkpoints" / step_dir_name(self.guard.best_step))
        self.stages.restore(ckpt, saved.get("aggregator"), None)
        if (saved.get("last_eval") or {}).get("step") == self.guard.best_step:
            self.state.last_eval = saved["last_eval"]

    def _restore(self) -> None:
        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        remove_partial(self.run_dir / "checkpoints")  # what a killed save left behind (no save is in flight now)
        saved = load_state(ckpt)
        check_data_hash(self.run_dir, self.train_rows, self.eval_rows, saved.get("data_hash"), self.probe_rows)
        self.stages.restore(ckpt, saved.get("aggregator"), saved.get("rollout_rng"))  # every rank, then the rollout
        self.sampler.load_state_dict(saved["sampler"])
        set_rng_state(saved["rng"])
        self.jsonl.truncate_after(saved["step"])
        truncate_samples(self.run_dir, saved["step"])
        self.state = RunState(saved["step"], saved["seconds"], saved["initial_eval"], saved["last_eval"])
        if self.guard is not None:
            self.guard.load_state_dict(saved.get("guard"))
            write_guard_log(self.run_dir, self.guard.events)  # firings after the checkpoint are redone


# ---------------------------------------------------------------- helpers


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)
