"""GRPO, top to bottom: prep, then [rollout -> (teacher) -> reward -> update -> (evaluate, probe, checkpoint)] x steps.

`run(cfg, run_dir)` is the only step loop in forgeweave (`python -m forge.recipes.grpo --preset tiny` runs it alone,
no Prefect, no Ray); `update_micro_batch` and `grpo_loss` are the update math, which the trainer (`forge.trainer`)
calls for each micro-batch while it keeps micro-batching, gradient sync, clipping and the optimizer. Every stage call
goes through one seam, `runner(Stage.X, step, fn, *args)`, with `fn` a method of a `Stages` object (`forge.stages`):
plain mode calls it, the Prefect flow makes it a task run, and under Ray the methods are calls on long-lived actors
Weaver placed. The run's context is one frozen `Run`, all that changes one `LoopState` (`forge.loop`), and every
helper here is `f(run, state, step) -> LoopState`; what is built from the config is `forge.recipes.wiring`.
Variants are config: `algo.loss` picks an objective and a normaliser from `LOSSES`, `algo.advantage` an estimator
(`forge.advantages`).

Departures from textbook GRPO (DeepSeekMath, Shao et al. 2024), each a config key:
1. no KL term by default (`algo.beta` = 0.0: no reference model is loaded); with beta > 0 it is the k3 estimator.
2. advantages are the group z-score with std + 1e-4 in the denominator (`algo.advantage` = zscore; also mean, loo).
3. the default loss `algo.loss` = grpo is the paper's sequence mean; dr_grpo, dapo (token mean, dual clip), gspo
   (one sequence ratio) and cispo are the variants.
4. log-probs are taken of logits / `rollout.temperature` (the distribution actually sampled), in fp32.
5. the log-ratio is clamped to +-20 before exp (`forge.losses.MAX_LOG_RATIO`).
6. an adaptive LR controller is on by default (`update.adaptive.enabled` = True): it cuts the LR when the grad
   norm per sqrt(mean |advantage|) spikes and the spike holds (`update.adaptive.signal` = grad_norm).
7. a step whose loss or gradient norm is not finite is skipped (`update.max_skipped_steps` = 3 in a row stop).
8. each micro-batch is packed without padding, a group's prompt computed once (`update.shared_prefix` = True).
9. asynchronous GRPO (`algo.max_staleness` = 0 by default): with k >= 1 the rollouts of steps t+1..t+k start before
   the update of step t, at most k versions behind (multi-turn: an episode's oldest turn), corrected with truncated
   importance weights (`algo.is_correction` = auto). The schedule is fixed, and no rollout starts past the next
   checkpoint, so a run gives the same result however fast its actors are, and resumes exactly.
10. multi-turn episodes (forge/env): the loss counts only sampled tokens (`Rollouts.loss_mask`; environment, tool and
   agent tokens are attended to only); an episode cut by a limit is left out (`env.mask_truncated` = True).
11. on-policy distillation (`distill.teacher`): a teacher's log-ratio as [N, T] advantages, or its top-k KL in the loss.

Randomness is derived, never carried: step t's prompts are rows (t - 1) * B .. t * B - 1 of a seeded order
(`forge.data.prompt_batch`), its rollout is seeded from (seed, t) (`forge.rollout.base.rollout_seed`) and the update's
dropout from (seed, t, rank) (`forge.trainer.update_seed`), so a retried, resumed or recovered step samples and trains
what the uninterrupted one did and no RNG state or data cursor is carried. Collapse guard (`collapse.probe_source`):
greedy pass@1 on a probe set the reward never sees; when it falls while reward/mean rises the run warns, rolls back
to the best-probe checkpoint or stops (`collapse.action`). Faults: a `WorkerLost` rebuilds the stages and continues
from the last checkpoint (`orchestration.max_restarts`).

Run directory: config.yaml (+ config_changes.jsonl), plan.json, status.json, data/, metrics.jsonl, samples.jsonl, eval/
(step-NNNNNN.json, probe-step-NNNNNN.json), checkpoints/step-NNNNNN/ + latest, ensemble/step-NNNNNN.json, guard.jsonl,
workers.json, inputs/ (datasets given to forge.train) and, once finished, summary.json.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from forge.checkpoint import load_state
from forge.compose import StagesFactory, local_stages
from forge.config import AlgoConfig, RunConfig
from forge.errors import UserError
from forge.guard import CollapseGuard
from forge.loop import (
    LoopState,
    Run,
    collect_saved,
    environment_streak,
    recover,
    request_of,
    restore,
    rollback_target,
    sampler_payload,
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
from forge.recipes.wiring import RunRecord, loop_context, prepare_data
from forge.records import MicroBatch, MicroStats
from forge.rundir import progress_bar, update_bar
from forge.stages import Stage, StageRunner, WorkerLost, call_stage
from forge.tracking import Tracker

# algo.loss -> (per-token objective, normaliser over the step): the variants differ in these two pieces only
LOSSES = {
    "grpo": (clipped_objective, sequence_mean),
    "dr_grpo": (clipped_objective, horizon_mean),
    "dapo": (dual_clip_objective, token_mean),
    "gspo": (clipped_objective, sequence_mean),  # with one ratio per sequence
    "cispo": (cispo_objective, token_mean),
}


def grpo_loss(logp, old_logp, advantages, mask, *, algo: AlgoConfig, totals: StepTotals, ref_logp=None,
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
    per_token = per_token if distill is None else per_token + distill  # a teacher's top-k KL (distill.topk)
    kl_old = (ratio.detach() - 1) - log_ratio.detach()  # approximate KL to pi_old
    loss = normalise(per_token, mask, totals)
    m = mask.bool()
    return LossOutput(loss, kl_old, None if kl_ref is None else kl_ref.detach(), low & m, high & m)


def update_micro_batch(policy, mb: MicroBatch, algo: AlgoConfig, totals: StepTotals, *, backward) -> MicroStats:
    """The GRPO update of one micro-batch: log-probs -> ratio -> loss -> backward. `policy(mb)` gives the current
    log-probs [n, T] (every real token attended); the loss, its normalisers, the importance weights, entropy, KL
    and the log-prob diff count only `mb.train_mask` (sampled tokens: environment and tool tokens carry no loss).
    `backward(loss)` accumulates the gradient (the trainer steps once per pass)."""
    out = policy(mb)  # log pi_theta of the sampled tokens and the entropy, [n, T]
    old = out.logp.detach() if mb.old_logp is None else mb.old_logp  # pi_old: the ratio is exactly 1 on pass 1
    weight = importance_weights(old, mb.sampler_logp, algo.is_cap) if algo.tis else None  # sampled by mu != pi_old
    distill = None if mb.teacher is None else mb.teacher.kl(out.extra)  # [n, T]: KL to a teacher's top k, weighted
    res = grpo_loss(out.logp, old, mb.advantages, mb.train_mask, algo=algo, totals=totals, ref_logp=mb.ref_logp,
                    is_weight=weight, distill=distill)
    backward(res.loss)
    return MicroStats.of(res, out.entropy, old, mb, weight, algo.is_cap, distill)


def run(cfg: RunConfig, run_dir: Path, *, resume: bool = False, tracker: Tracker | None = None, progress: bool = True,
        plan: dict | None = None, stages: StagesFactory = local_stages, runner: StageRunner = call_stage,
        **summary_extra) -> dict:  # fmt: skip
    """Train with GRPO and return summary.json's content. Raises UserError for problems a user can fix.
    `stages(cfg, run_dir, plan, update_fn)` builds the workers (in-process by default); `runner` runs each stage."""
    cfg, run_dir = cfg.validate(), Path(run_dir)
    record = RunRecord(cfg, run_dir, resume, tracker=tracker, plan=plan)
    with record.failed_on_error():
        resume = record.resume_from is not None  # stopped before its first checkpoint: from step 0
        if not resume:
            record.fresh()
            runner(Stage.PREPARE, 0, prepare_data, cfg, run_dir)  # data/{train,eval,probe}.parquet, manifest
        build = lambda: loop_context(cfg, stages(cfg, run_dir, plan, update_micro_batch), runner, record)  # noqa: E731
        run_ = build()
        try:
            guard = CollapseGuard.for_run(cfg.collapse) if run_.sched.probe_every else None
            state = restore(run_, LoopState(guard=guard), record.resume_from) if resume else first_eval(run_, guard)
            first, bar = state, progress_bar(cfg.steps, state.step, progress)  # first: what a recovery redoes
            while state.step < cfg.steps and not state.stopped:
                try:
                    state = grpo_step(run_, state, state.step + 1)
                    update_bar(bar, state.last_reward, state.last_eval)
                except WorkerLost as lost:  # rebuild the workers; continue from the last checkpoint
                    state = dataclasses.replace(state, restarts=state.restarts + 1, ahead=())
                    if state.restarts > (cap := cfg.orchestration.max_restarts):
                        raise UserError(f"{lost} (after {state.restarts - 1} restarts; orchestration.max_restarts="
                                        f"{cap}); continue with --resume") from lost  # fmt: skip
                    say(f"forgeweave: {lost}; restarting the workers ({state.restarts}/{cap})")
                    run_.work.close()
                    run_ = build()
                    state = recover(run_, state, first)
            if bar is not None:
                bar.close()
            state = collect_saved(run_, state)
        finally:
            run_.work.close()  # also on Ctrl-C / SIGTERM: no process outlives the run
        extra = {**summary_extra, "restarts": state.restarts}
        extra.update(state.guard.summary(state.stopped) if state.guard else {})
        if state.saved is not None:
            extra["checkpoint"] = {"async_save": cfg.checkpoint.async_save, "bytes": state.saved.bytes,
                                   "last": Path(state.saved.path).name}  # fmt: skip
        return record.finish(state, extra)


def grpo_step(run: Run, state: LoopState, step: int) -> LoopState:
    """One GRPO step; returns the loop state after it."""
    clock, record = Stopwatch(), run.record
    state = start_rollouts(run, state, step)  # B prompts from (seed, step) (and up to k later steps started)
    request = next(r for r in state.ahead if r.step == step)
    state = dataclasses.replace(state, step=step, ahead=tuple(r for r in state.ahead if r.step != step))
    with clock("rollout"):  # 1. G samples for each of B prompts, from a policy <= k versions old
        rollouts = run.runner(Stage.ROLLOUT, step, run.work.rollout, request)
    stale = checked_staleness(step, run.work.policy_version, sampled_versions(rollouts), run.max_staleness)
    teacher = None
    if run.distills:  # 1b. the teacher's log-probs of the samples: a dense reward, and its top k for the loss
        with clock("teacher"):
            teacher = run.runner(Stage.TEACHER, step, run.work.teacher, rollouts)
    with clock("reward"):  # 2. verifiers -> reward -> group-relative advantages (+ the teacher's per-token term)
        scores = run.runner(Stage.REWARD, step, run.work.reward, request.rows, rollouts, step, teacher)
    state = dataclasses.replace(state, shown_errors=show_verifier_errors(scores, step, state.shown_errors))
    state = verifier_streaks(environment_streak(state, rollouts), scores)
    if reason := stop_reason(state, scores, run.limits):  # a verifier or the environment failing on every item
        raise UserError(reason)
    with clock("update"):  # 3. log-probs -> ratio -> loss -> backward -> step (update_micro_batch); new weights out
        stats = run.runner(Stage.UPDATE, step, run.work.update, rollouts, scores.advantages, teacher)
    if reason := stop_reason(state := update_streak(state, stats), scores, run.limits):  # non-finite updates
        raise UserError(reason)
    report = None
    if run.sched.eval_due(step):  # 4. held-out pass@1 on schedule
        with clock("evaluate"):
            report = run.runner(Stage.EVALUATE, step, run.work.evaluate, run.data.eval, step)
        record.eval_report(report)
        state = dataclasses.replace(state, last_eval=report)
    metrics = {**step_metrics(rollouts, scores, stats, clock.laps, clock.elapsed(), stale),
               **eval_metrics(report or {})}  # fmt: skip
    guard = state.guard.observe(step, metrics["reward/mean"]) if state.guard else None
    state = dataclasses.replace(state.timed(clock.laps), last_reward=metrics["reward/mean"], guard=guard)
    record.step(step, metrics, rows=request.rows, rollouts=rollouts, batch=scores, teacher=teacher, stats=stats)
    if run.sched.probe_due(step):  # 5. labelled probe -> collapse guard: warn, roll back or stop
        state = probe(run, state, step)
    if run.sched.checkpoint_due(step):  # 6. weights, optimizer, loop state (the prompt order's next row); atomically
        state = checkpoint(run, state, step)
    return state


def start_rollouts(run: Run, state: LoopState, step: int) -> LoopState:
    """The state with step `step`'s rollout request started; asynchronous GRPO also starts those of up to
    algo.max_staleness later steps from the policy the trainer holds now, never past the next checkpoint (in-flight
    work is drained there). A request is started once (`prefetch`, on Ray) and kept in `state.ahead` until its step."""
    started = {r.step for r in state.ahead}
    last = min(step + run.max_staleness, run.sched.next_checkpoint(step))
    new = tuple(request_of(run, state, s) for s in range(step, last + 1) if s not in started)
    for request in new:
        run.work.prefetch(request)
    return dataclasses.replace(state, ahead=(*state.ahead, *new))


def probe(run: Run, state: LoopState, step: int) -> LoopState:
    """Greedy pass@1 on the probe rows; the guard decides; a firing is printed and logged, maybe restored from."""
    rows = run.data.probe[: run.probe_rows]
    report = run.runner(Stage.PROBE, step, run.work.evaluate, rows, step, True)
    run.record.eval_report(report, probe=True)
    guard, event = state.guard.probe(step, report["pass@1"])
    run.record.probe(step, report, guard.metrics(event), list(guard.events))
    state = dataclasses.replace(state.timed({"probe": report["seconds"]}), guard=guard)
    if event is None:
        return state
    say(event.line())
    if event.action in ("rollback", "stop"):  # the best probe's weights, optimizer, reward state (and eval)
        state = collect_saved(run, state)  # it may still be in flight; retention keeps it
        ckpt, guard = rollback_target(step, run.record, state.guard)  # the best probe's, or the newest intact before
        saved = load_state(ckpt)
        run.work.restore(ckpt, saved.get("aggregator"))  # new prompts and rollout seeds go on
        last = saved["last_eval"] if (saved.get("last_eval") or {}).get("step") == saved["step"] else state.last_eval
        state = dataclasses.replace(state, guard=guard, last_eval=last)
    stopped = event.line().removeprefix("forgeweave: ") if event.action == "stop" else ""
    return dataclasses.replace(state, stopped=stopped)


def checkpoint(run: Run, state: LoopState, step: int) -> LoopState:
    """Start checkpoint `step` once the previous one is durable (at most one in flight); written in the background
    (`checkpoint.async_save`) or waited for here."""
    start_s = time.perf_counter()
    state = collect_saved(run, state)
    last = state.last_eval
    score = last["pass@1"] if last and last.get("step") == step else None
    score = state.guard.score_at(step) if state.guard else score  # retention: the best by probe pass@1 if probed
    payload = {**state.payload(), "sampler": sampler_payload(run, state, step), "aggregator": run.work.reward_state(),
               "data_hash": run.data.hash}  # fmt: skip
    run.runner(Stage.CHECKPOINT, step, run.work.save, run.record.run_dir / "checkpoints", step, payload, score)
    state = dataclasses.replace(state, saving=(step, time.perf_counter() - start_s))
    state = state if run.async_save else collect_saved(run, state)
    return state.timed({"checkpoint": time.perf_counter() - start_s})


def first_eval(run: Run, guard: CollapseGuard | None) -> LoopState:
    """Step 0: the initial evaluation; with a probe set the guard's first best (and a checkpoint to roll back to)."""
    report = run.runner(Stage.EVALUATE, 0, run.work.evaluate, run.data.eval, 0)
    run.record.eval_report(report)
    run.record.log(eval_metrics(report), 0)
    state = LoopState(initial_eval=report, last_eval=report, guard=guard).timed({"evaluate": report["seconds"]})
    if guard is not None:
        state = probe(run, state, 0)
        if run.sched.restores:
            state = checkpoint(run, state, 0)
    run.record.status("running", 0)
    return state


if __name__ == "__main__":  # python -m forge.recipes.grpo --preset tiny: the recipe alone, no Prefect, no Ray
    from forge.recipes.cli import main

    main(run)
