"""GRPO, top to bottom: prep, then [rollout -> reward -> update -> (evaluate, probe, checkpoint)] x steps.

`run(cfg, run_dir)` is the only step loop in forgeweave; `update_micro_batch` and `grpo_loss` are the update math,
which the trainer (`forge.trainer`) calls for each micro-batch while it keeps micro-batching, gradient sync,
clipping and the optimizer. Every stage call goes through one seam, `runner(Stage.X, step, fn, *args)`, with `fn`
a method of a `Stages` object (`forge.stages`): plain mode calls it, the Prefect flow makes it a task run, and
under Ray the methods are calls on long-lived actors Weaver placed. Bookkeeping (the run record, the schedule,
stop rules) is `forge.loop`, outside the seam. Variants are config: `algo.loss` picks an objective and a
normaliser from `LOSSES`, `algo.advantage` an estimator (`forge.advantages`).

Departures from textbook GRPO (DeepSeekMath, Shao et al. 2024), each a config key:
1. no KL term by default (`algo.beta` = 0.0: no reference model is loaded); with beta > 0 it is the k3 estimator.
2. advantages are the group z-score with std + 1e-4 in the denominator (`algo.advantage` = zscore; also mean, loo).
3. the default loss `algo.loss` = grpo is the paper's sequence mean; dr_grpo, dapo (token mean, dual clip), gspo
   (one sequence ratio) and cispo are the variants.
4. log-probs are taken of logits / `rollout.temperature` (the distribution actually sampled), in fp32.
5. the log-ratio is clamped to +-20 before exp (`forge.losses.MAX_LOG_RATIO`).
6. an adaptive LR controller is on by default (`update.adaptive.enabled` = True): it cuts the LR when the grad
   norm per unit of mean |advantage| spikes (`update.adaptive.signal` = grad_norm).
7. a step whose loss or gradient norm is not finite is skipped (`update.max_skipped_steps` = 3 in a row stop).
8. each micro-batch is packed without padding, a group's prompt computed once (`update.shared_prefix` = True).
9. asynchronous GRPO (`algo.max_staleness` = 0 by default): with k >= 1 the rollouts of steps t+1..t+k start
   before the update of step t, at most k versions behind (in a multi-turn run, per episode: its oldest turn's
   version), corrected with truncated importance weights (`algo.is_correction` = auto). The schedule is fixed, not
   timing-dependent, and no rollout starts past the next checkpoint, so a run gives the same result however fast
   its actors are, and resumes exactly.
10. multi-turn episodes (`env.environment_factory`, `env.tools`; forge/env): one token sequence per episode; the loss
   counts only the tokens the policy sampled (`Rollouts.loss_mask`), environment and tool tokens are attended to
   only, and an episode cut by a limit is left out of the loss (`env.mask_truncated` = True).
11. on-policy distillation (`reward.teacher`): a teacher's log-ratio as [N, T] advantages, or its top-k KL in the loss.

Randomness is derived, never carried: step t's rollout is seeded from (seed, t) (`forge.rollout.base.rollout_seed`) and
the update's dropout from (seed, t, rank) (`forge.trainer.update_seed`), so a retried, resumed or recovered step samples
and trains what the uninterrupted one did and no RNG state is saved. Collapse guard (`collapse.probe_source`): greedy
pass@1 on a probe set the reward never sees; when it falls while reward/mean rises the run warns, rolls back to the
best-probe checkpoint or stops (`collapse.action`). Faults: a `WorkerLost` rebuilds the stages and continues from the
last checkpoint (`orchestration.max_restarts`).

Run directory: config.yaml (+ config_changes.jsonl), plan.json, status.json, data/, metrics.jsonl, samples.jsonl,
eval/step-NNNNNN.json, eval/probe-step-NNNNNN.json, checkpoints/step-NNNNNN/ + latest, ensemble/step-NNNNNN.json,
guard.jsonl, workers.json, inputs/ (datasets given to forge.train) and, once finished, summary.json.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from forge.checkpoint import load_state
from forge.config import AlgoConfig, RunConfig
from forge.errors import UserError
from forge.guard import CollapseGuard
from forge.loop import (
    Data,
    LoopState,
    RunRecord,
    Schedule,
    collect_saved,
    environment_streak,
    prepare_data,
    recover,
    restore,
    rollback_target,
    say,
    stop_reason,
    update_streak,
    verifier_streaks,
)
from forge.losses import (
    MAX_LOG_RATIO,
    LossOutput,
    StepTotals,
    cispo_objective,
    clipped_objective,
    dual_clip_objective,
    horizon_mean,
    importance_weights,
    k3_kl,
    sequence_log_ratio,
    sequence_mean,
    token_mean,
)
from forge.metrics import (
    Stopwatch,
    checked_staleness,
    eval_metrics,
    sampled_versions,
    show_verifier_errors,
    step_metrics,
)
from forge.records import MicroBatch, MicroStats, RolloutRequest
from forge.rollout.base import SamplingParams, rollout_seed
from forge.rundir import progress_bar, update_bar
from forge.stages import LocalStages, Stage, StageRunner, Stages, StagesFactory, WorkerLost, call_stage
from forge.tracking import Tracker

# algo.loss -> (per-token objective, normaliser over the step): the variants differ in these two pieces only
LOSSES = {
    "grpo": (clipped_objective, sequence_mean),
    "dr_grpo": (clipped_objective, horizon_mean),
    "dapo": (dual_clip_objective, token_mean),
    "gspo": (clipped_objective, sequence_mean),  # with one ratio per sequence
    "cispo": (cispo_objective, token_mean),
}


def grpo_loss(logp, old_logp, advantages, mask, algo: AlgoConfig, totals: StepTotals, ref_logp=None,
              is_weight=None, distill=None) -> LossOutput:  # fmt: skip
    """A micro-batch's share of the step's policy loss. [n, T] log-probs, mask and distill, [n] or [n, T] advantages."""
    mask, adv = mask.to(logp.dtype), advantages.to(logp.dtype)  # [n] one per completion, or [n, T] one per token
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [n, 1]: on each of the completion's tokens; [n, T] as given
    log_ratio = (logp - old_logp.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [n, T]
    if algo.loss == "gspo":
        log_ratio = sequence_log_ratio(log_ratio, logp, mask)
    ratio = torch.exp(log_ratio)
    objective, normalise = LOSSES[algo.loss]
    per_token, low, high = objective(ratio, adv, logp, algo)  # [n, T]
    per_token = per_token if is_weight is None else per_token * is_weight.detach()  # off-policy: pi_old / mu, cut
    assert algo.beta == 0 or ref_logp is not None, "beta > 0 needs reference log-probs"
    kl_ref = k3_kl(ref_logp, logp) if algo.beta > 0 else None  # [n, T]
    per_token = per_token if kl_ref is None else per_token + algo.beta * kl_ref
    per_token = per_token if distill is None else per_token + distill  # a teacher's top-k KL (reward.teacher_topk)
    kl_old = (ratio.detach() - 1) - log_ratio.detach()  # approximate KL to pi_old
    loss = normalise(per_token, mask, totals)
    m = mask.bool()
    return LossOutput(loss, kl_old, None if kl_ref is None else kl_ref.detach(), low & m, high & m)


def update_micro_batch(policy, mb: MicroBatch, algo: AlgoConfig, totals: StepTotals, backward) -> MicroStats:
    """The GRPO update of one micro-batch: log-probs -> ratio -> loss -> backward. `policy(mb)` gives the current
    log-probs [n, T] (every real token attended); the loss, its normalisers, the importance weights, entropy, KL
    and the log-prob diff count only `mb.train_mask` (sampled tokens: environment and tool tokens carry no loss).
    `backward(loss)` accumulates the gradient (the trainer steps once per pass)."""
    out = policy(mb)  # log pi_theta of the sampled tokens and the entropy, [n, T]
    old = out.logp.detach() if mb.old_logp is None else mb.old_logp  # pi_old: the ratio is exactly 1 on pass 1
    weight = importance_weights(old, mb.sampler_logp, algo.is_cap) if algo.tis else None  # sampled by mu != pi_old
    distill = None if mb.teacher is None else mb.teacher.kl(out.extra)  # [n, T]: KL to a teacher's top k, weighted
    res = grpo_loss(out.logp, old, mb.advantages, mb.train_mask, algo, totals, mb.ref_logp, weight, distill)
    backward(res.loss)
    return MicroStats.of(res, out.entropy, old, mb, weight, algo.is_cap, distill)


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, tracker: Tracker | None = None, progress: bool = True,
        plan: dict | None = None, stages: StagesFactory = LocalStages, runner: StageRunner = call_stage,
        **summary_extra) -> dict:  # fmt: skip
    """Train with GRPO and return summary.json's content. Raises UserError for problems a user can fix.
    `stages(cfg, run_dir, plan, update_fn)` builds the workers (in-process by default); `runner` runs each stage."""
    cfg, run_dir = cfg.validate(), Path(run_dir)
    record = RunRecord(cfg, run_dir, resume, tracker, plan)
    with record.failed_on_error():
        resume = record.resume_from is not None  # stopped before its first checkpoint: from step 0
        if not resume:
            record.fresh()
            runner(Stage.PREPARE, 0, prepare_data, cfg, run_dir)  # data/{train,eval,probe}.parquet, manifest
        data = Data.read(cfg, run_dir)
        sched = Schedule.of(cfg)
        guard = CollapseGuard.for_run(cfg.collapse) if sched.probe_every else None
        work, restarts, ahead = start(stages, cfg, run_dir, plan, record), 0, {}
        try:
            state = restore(record.resume_from, work, data, record, guard) if resume else \
                first_eval(cfg, work, runner, data, record, guard, sched)  # fmt: skip
            first = (state, guard.state_dict() if guard else None)  # what a recovery before any checkpoint redoes
            bar = progress_bar(cfg.steps, state.step, progress)
            while state.step < cfg.steps and not state.stopped:
                try:
                    state = grpo_step(state.step + 1, state, cfg, work, runner, data, record, guard, sched, ahead)
                    update_bar(bar, state.last_reward, state.last_eval)
                except WorkerLost as lost:  # rebuild the workers; continue from the last checkpoint
                    restarts += 1
                    if restarts > cfg.orchestration.max_restarts:
                        raise UserError(
                            f"{lost} (after {restarts - 1} restarts; orchestration.max_restarts="
                            f"{cfg.orchestration.max_restarts}); continue with --resume"
                        ) from lost
                    say(f"forgeweave: {lost}; restarting the workers ({restarts}/{cfg.orchestration.max_restarts})")
                    work.close()
                    work, ahead = start(stages, cfg, run_dir, plan, record), {}
                    state = recover(first, work, data, record, guard)
            if bar is not None:
                bar.close()
            state = collect_saved(state, work, record)
        finally:
            work.close()  # also on Ctrl-C / SIGTERM: no process outlives the run
        extra = {**summary_extra, "restarts": restarts, **(guard.summary(state.stopped) if guard else {})}
        if state.saved is not None:
            extra["checkpoint"] = {"async_save": cfg.checkpoint.async_save, "bytes": state.saved.bytes,
                                   "last": Path(state.saved.path).name}  # fmt: skip
        return record.finish(state, extra)


def grpo_step(step: int, state: LoopState, cfg: RunConfig, work: Stages, runner: StageRunner, data: Data,
              record: RunRecord, guard: CollapseGuard | None, sched: Schedule, ahead: dict) -> LoopState:  # fmt: skip
    """One GRPO step; returns the loop state after it."""
    clock = Stopwatch()
    request = next_request(step, cfg, work, data, sched, ahead)  # B prompts (and up to k later steps started)
    with clock("rollout"):  # 1. G samples for each of B prompts, from a policy <= k versions old
        rollouts = runner(Stage.ROLLOUT, step, work.rollout, request)
    stale = checked_staleness(step, work.policy_version, sampled_versions(rollouts), cfg.algo.max_staleness)
    with clock("reward"):  # 2. verifiers -> reward -> group-relative advantages
        scores = runner(Stage.REWARD, step, work.reward, request.rows, rollouts, step)
    show_verifier_errors(scores, step, record.shown_errors)
    state = verifier_streaks(environment_streak(dataclasses.replace(state, step=step), rollouts), scores)
    if reason := stop_reason(state, scores, cfg):  # a verifier or the environment failing on every item
        raise UserError(reason)
    with clock("update"):  # 3. log-probs -> ratio -> loss -> backward -> step (update_micro_batch); new weights out
        stats = runner(Stage.UPDATE, step, work.update, rollouts, scores.advantages, scores.teacher_topk)
    if reason := stop_reason(state := update_streak(state, stats), scores, cfg):  # too many non-finite updates
        raise UserError(reason)
    report = None
    if sched.eval_due(step):  # 4. held-out pass@1 on schedule
        with clock("evaluate"):
            report = runner(Stage.EVALUATE, step, work.evaluate, data.eval, step)
        record.eval_report(report)
        state = dataclasses.replace(state, last_eval=report)
    metrics = {**step_metrics(rollouts, scores, stats, clock.laps, clock.elapsed(), stale),
               **eval_metrics(report or {})}  # fmt: skip
    state = dataclasses.replace(state.timed(clock.laps), last_reward=metrics["reward/mean"])
    if guard is not None:
        guard.observe(step, metrics["reward/mean"])
    record.step(step, metrics, request.rows, rollouts, scores)
    if sched.probe_due(step):  # 5. labelled probe -> collapse guard: warn, roll back or stop
        state = probe(step, state, cfg, work, runner, data, record, guard)
    if sched.checkpoint_due(step):  # 6. weights, optimizer, data cursor, loop state; atomically
        state = checkpoint(step, state, cfg, work, runner, data, record, guard)
    return state


def next_request(step: int, cfg: RunConfig, work: Stages, data: Data, sched: Schedule, ahead: dict) -> RolloutRequest:
    """Step `step`'s rollout request; asynchronous GRPO also starts those of up to algo.max_staleness later steps
    from the policy the trainer holds now, never past the next checkpoint (in-flight work is drained there)."""
    r = cfg.rollout
    for s in range(step, min(step + cfg.algo.max_staleness, sched.next_checkpoint(step)) + 1):
        if s not in ahead:
            rows = data.sampler.next_batch(r.prompts_per_step)
            params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.group_size, rollout_seed(cfg.seed, s))
            ahead[s] = RolloutRequest(s, rows, [row["model_input"] for row in rows], params, work.policy_version)
            work.prefetch(ahead[s])
    return ahead.pop(step)


def probe(step, state, cfg, work, runner, data, record, guard) -> LoopState:
    """Greedy pass@1 on the probe rows; the guard decides; a firing is printed and logged, maybe restored from."""
    report = runner(Stage.PROBE, step, work.evaluate, data.probe[: cfg.collapse.probe_max_problems], step, True)
    record.eval_report(report, probe=True)
    event = guard.probe(step, report["pass@1"])
    record.probe(step, report, guard.metrics(event), guard.events)
    state = state.timed({"probe": report["seconds"]})
    if event is None:
        return state
    say(event.line())
    if event.action in ("rollback", "stop"):  # the best probe's weights, optimizer, reward state (and eval)
        state = collect_saved(state, work, record)  # it may still be in flight; retention keeps it
        ckpt = rollback_target(step, record, guard)  # the best probe's, or the newest intact one before it
        saved = load_state(ckpt)
        work.restore(ckpt, saved.get("aggregator"))  # new prompts and rollout seeds go on
        if (saved.get("last_eval") or {}).get("step") == saved["step"]:
            state = dataclasses.replace(state, last_eval=saved["last_eval"])
    stopped = event.line().removeprefix("forgeweave: ") if event.action == "stop" else ""
    return dataclasses.replace(state, stopped=stopped)


def checkpoint(step, state, cfg, work, runner, data, record, guard) -> LoopState:
    """Start checkpoint `step` once the previous one is durable (at most one in flight); written in the background
    (`checkpoint.async_save`) or waited for here."""
    start = time.perf_counter()
    state = collect_saved(state, work, record)
    last = state.last_eval
    score = last["pass@1"] if last and last.get("step") == step else None
    score = guard.score_at(step) if guard else score  # retention: the best by probe pass@1 if probed
    payload = {**state.payload(), "sampler": data.sampler.state_dict(), "aggregator": work.reward_state(),
               "data_hash": data.hash, "guard": guard.state_dict() if guard else None}  # fmt: skip
    runner(Stage.CHECKPOINT, step, work.save, record.run_dir / "checkpoints", step, payload, score)
    state = dataclasses.replace(state, saving=(step, time.perf_counter() - start))
    state = state if cfg.checkpoint.async_save else collect_saved(state, work, record)
    return state.timed({"checkpoint": time.perf_counter() - start})


def start(stages: StagesFactory, cfg: RunConfig, run_dir: Path, plan: dict | None, record: RunRecord) -> Stages:
    """The workers (update ranks, rollout engines, reward), recorded in workers.json and the tracker."""
    work = stages(cfg, run_dir, plan, update_micro_batch)
    record.started_workers(work.where())
    record.track_start()
    return work


def first_eval(cfg, work, runner, data, record, guard, sched) -> LoopState:
    """Step 0: the initial evaluation; with a probe set the guard's first best (and a checkpoint to roll back to)."""
    report = runner(Stage.EVALUATE, 0, work.evaluate, data.eval, 0)
    record.eval_report(report)
    record.log(eval_metrics(report), 0)
    state = LoopState(initial_eval=report, last_eval=report).timed({"evaluate": report["seconds"]})
    if guard is not None:
        state = probe(0, state, cfg, work, runner, data, record, guard)
        if sched.restores:
            state = checkpoint(0, state, cfg, work, runner, data, record, guard)
    record.status("running", 0)
    return state
