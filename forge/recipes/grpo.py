"""GRPO, top to bottom: prep → [rollout → reward → advantages → update → (evaluate, checkpoint)] × steps.

Runnable without Prefect: `run(cfg, run_dir)` does the whole job and returns the summary. The flows call the
same stage functions one by one. Variants (Dr. GRPO, DAPO, GSPO, CISPO, RLOO advantages) are config choices
of the components (`forge.losses`, `forge.advantages`), not branches in this loop.

Run directory (the contract other tools read): config.yaml, status.json, data/{train,eval}.parquet,
data/manifest.json, metrics.jsonl, samples.jsonl, eval/step-NNNNNN.json, checkpoints/step-NNNNNN/ +
checkpoints/latest, update/ when the update runs on several processes (their config, log, pids; see
forge/distributed/remote.py), and summary.json only once the run has finished.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forge.advantages import frac_zero_std, group_advantages
from forge.checkpoint import (
    apply_retention,
    latest_checkpoint,
    load_state,
    save_checkpoint,
    set_rng_state,
    step_dir_name,
)
from forge.config import RunConfig, dump_yaml
from forge.data import PromptSampler, prepare, read_split
from forge.distributed.remote import start_trainer
from forge.errors import UserError
from forge.evaluate import evaluate
from forge.io import atomic_write_text, write_json
from forge.models import format_prompt_fn, load_policy
from forge.records import Rollouts, ScoredBatch, UpdateStats
from forge.rewards.registry import resolve_verifiers
from forge.rewards.score import per_verifier_means, score_completions
from forge.rollout import SamplingParams, make_backend
from forge.rundir import (
    append_samples,
    claim_run_dir,
    progress_bar,
    run_summary,
    track_run_start,
    truncate_samples,
    update_bar,
    write_status,
)
from forge.tracking import JsonlTracker, MultiTracker, Tracker

if TYPE_CHECKING:
    from forge.distributed.remote import RemoteTrainer
    from forge.trainer import Trainer

STAGES = ("rollout", "reward", "update", "evaluate")


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
    balancer=None,
) -> dict:
    """Train with GRPO and return summary.json's content. Raises UserError for problems a user can fix."""
    grpo = GRPORun(cfg, Path(run_dir), resume=resume, tracker=tracker, plan=plan, balancer=balancer)
    with grpo.failure_guard():
        grpo.setup()
        bar = progress_bar(cfg.steps, grpo.state.step, progress)
        for step in grpo.remaining_steps():
            rows, rollouts = grpo.rollout(step)  # 1. G samples for each of B prompts, current policy version
            batch = grpo.reward(rows, rollouts)  # 2. verifiers -> weighted reward -> group-relative advantages
            stats = grpo.update(batch)  # 3. PPO-style passes; the backend then samples from the new weights
            report = grpo.evaluate(step) if grpo.eval_due(step) else None  # 4. held-out pass@1 on schedule
            metrics = grpo.end_step(step, rows, batch, stats, report)  # 5. log metrics and samples
            if grpo.checkpoint_due(step):
                grpo.checkpoint(step)  # 6. weights + optimizer + RNG + data cursor, atomically
            update_bar(bar, metrics, grpo.state.last_eval)
        if bar is not None:
            bar.close()
        return grpo.finish()


class GRPORun:
    """The stages of one GRPO run over shared state. `run()` chains them; a Prefect flow calls them as tasks."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: bool = False,
        tracker: Tracker | None = None,
        plan: dict | None = None,
        attach: bool = False,
        balancer=None,
    ):
        """Claim the run directory (new, or existing with resume; `attach`: a driver created it, use it as it is);
        `plan` (a resource plan) is saved as plan.json. `balancer(replicas)` splits rollout prompts across vLLM
        replicas (flows pass weaver's ThroughputBalancer)."""
        self.cfg = cfg.validate()
        self.balancer = balancer
        self.run_dir = run_dir
        self.resume = resume
        self.plan = plan
        self.started = time.perf_counter()
        if not attach:
            claim_run_dir(run_dir, resume)
        if plan is not None:
            write_json(run_dir / "plan.json", plan)
        self.jsonl = JsonlTracker(run_dir)
        self.tracker: Tracker = MultiTracker(self.jsonl, tracker) if tracker else self.jsonl
        self.state = RunState()
        self.times: dict[str, float] = {}
        self.sync_s = 0.0

    @contextlib.contextmanager
    def failure_guard(self):
        """Mark the run failed (status.json, tracker) if anything below raises; never swallow the error."""
        try:
            yield
        except BaseException as e:
            write_status(self.run_dir, "failed", step=self.state.step, error=f"{type(e).__name__}: {e}")
            self.tracker.finish("FAILED")
            raise
        finally:  # also on Ctrl-C / SIGTERM (the CLI turns it into SystemExit): no process outlives the run
            self.close()

    def close(self) -> None:
        """Stop the processes this run started (update ranks, vLLM engines); safe to call twice."""
        for part in (getattr(self, "trainer", None), getattr(self, "backend", None)):
            if part is not None:
                part.close()

    def setup(self) -> None:
        """Prep stage + everything the loop needs; then restore (resume) or run the initial evaluation."""
        self.build()
        track_run_start(self.tracker, self.cfg, self.run_dir)
        if self.resume:
            self.state = _restore(self.run_dir, self.trainer, self.sampler, self.jsonl, self.aggregator)
            self.backend.sync_weights(self.trainer.unwrapped, self.trainer.policy_version)
        else:
            self.state.initial_eval = self.state.last_eval = self._eval_report(0)
            self.state.seconds["evaluate"] += self.state.initial_eval["seconds"]
            self.tracker.log_metrics(eval_metrics(self.state.initial_eval), step=0)
        write_status(self.run_dir, "running", step=self.state.step)

    def build(self) -> None:
        """Policy, data (prepared unless resuming), sampler, verifiers, aggregator, trainer, rollout backend."""
        cfg, run_dir = self.cfg, self.run_dir
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        model, self.tok = load_policy(cfg.model, seed=cfg.seed)
        if not self.resume:
            atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
            fmt = format_prompt_fn(self.tok, cfg.model)
            prepare(cfg, run_dir, fmt, lambda s: len(self.tok(s, add_special_tokens=False).input_ids))
        self.train_rows, self.eval_rows = read_split(run_dir, "train"), read_split(run_dir, "eval")
        self.sampler = PromptSampler(self.train_rows, seed=cfg.seed)
        self.verifiers = resolve_verifiers(cfg.reward.verifiers)
        self.aggregator = None
        if cfg.reward.aggregate == "ensemble":
            from forge.rewards.aggregate import EnsembleAggregator

            names = [name for name, _ in self.verifiers]
            r = cfg.reward
            self.aggregator = EnsembleAggregator(
                names, r.window_steps, r.refit_every, cfg.seed, r.ensemble_model, r.ensemble_classes, r.necessary_checks
            )
        # in-process with one update process; else persistent `accelerate launch` ranks publishing their weights
        self.trainer = start_trainer(model, cfg, run_dir, self.plan)
        self.backend = make_backend(
            cfg.rollout.backend,
            self.trainer.unwrapped,
            self.tok,
            autocast_bf16=cfg.rollout.autocast_bf16,
            rollout=cfg.rollout,
            work_dir=run_dir,
            balancer=self.balancer,
        )
        self.ensemble_report = None

    def remaining_steps(self) -> range:
        return range(self.state.step + 1, self.cfg.steps + 1)

    def rollout(self, step: int) -> tuple[list[dict], Rollouts]:
        t0 = time.perf_counter()
        rows = self.sampler.next_batch(self.cfg.rollout.prompts_per_step)
        r = self.cfg.rollout
        params = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, n=r.group_size
        )
        rollouts = self.backend.generate([row["model_input"] for row in rows], params)
        if rollouts.policy_version != self.trainer.policy_version:
            raise RuntimeError(
                f"step {step}: rollout used policy version {rollouts.policy_version}, "
                f"trainer is at {self.trainer.policy_version} (stale weights)"
            )
        self.times = {"rollout": time.perf_counter() - t0}
        return rows, rollouts

    def reward(self, rows: list[dict], rollouts: Rollouts) -> ScoredBatch:
        t0 = time.perf_counter()
        g, step = self.cfg.rollout.group_size, self.state.step + 1
        hidden = ("answer",) if self.cfg.reward.label_free else ()
        result = score_completions(
            self.verifiers, self.cfg.reward.weights, rollouts.prompts, rollouts.texts, _columns(rows, g, hidden)
        )
        rewards = result.rewards  # [N]
        self.ensemble_report = None
        if self.aggregator is not None:  # label-free: P(correct | the V scores), refit on recent steps
            rewards, self.ensemble_report = self.aggregator(result.scores, g, step)
        advantages = group_advantages(rewards, g, self.cfg.algo.advantage)  # [N]
        batch = ScoredBatch(
            rollouts=rollouts,
            verifier_names=result.names,
            scores=result.scores,
            rewards=rewards,
            advantages=advantages,
            verifier_failures=result.failures,
        )
        self.times["reward"] = time.perf_counter() - t0
        return batch

    def update(self, batch: ScoredBatch) -> UpdateStats:
        t0 = time.perf_counter()
        stats = self.trainer.update(batch)
        self.sync_s = self.backend.sync_weights(self.trainer.unwrapped, self.trainer.policy_version)
        self.times["update"] = time.perf_counter() - t0
        return stats

    def eval_due(self, step: int) -> bool:
        return _due(step, self.cfg.eval.every, self.cfg.steps)

    def evaluate(self, step: int) -> dict:
        report = self._eval_report(step)
        self.state.last_eval = report
        self.times["evaluate"] = report["seconds"]
        return report

    def end_step(
        self, step: int, rows: list[dict], batch: ScoredBatch, stats: UpdateStats, report: dict | None
    ) -> dict[str, float]:
        """Log the step's metrics and samples; returns the metrics."""
        metrics = _step_metrics(batch.rollouts, batch, stats, self.times)
        # new weights -> rollout: update ranks' publication + the pipeline's load, then the backend's own sync (vLLM
        # engines); part of time/update_s
        metrics["perf/weight_sync_s"] = stats.sync_seconds + self.sync_s
        if report is not None:
            metrics.update(eval_metrics(report))
        if self.ensemble_report is not None:
            from forge.rewards.aggregate import report_metrics

            metrics.update(report_metrics(self.ensemble_report))
            write_json(self.run_dir / "ensemble" / f"{step_dir_name(step)}.json", self.ensemble_report)
        for k, v in self.times.items():
            self.state.seconds[k] += v
        self.state.step = step
        self.tracker.log_metrics(metrics, step=step)
        self.tracker.log_table("samples", step, append_samples(self.run_dir, step, rows, batch))
        write_status(self.run_dir, "running", step=step)
        return metrics

    def checkpoint_due(self, step: int) -> bool:
        return _due(step, self.cfg.checkpoint.every, self.cfg.steps)

    def checkpoint(self, step: int) -> Path:
        payload = {
            "trainer": self.trainer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "seconds": dict(self.state.seconds),
            "initial_eval": self.state.initial_eval,
            "last_eval": self.state.last_eval,
            "aggregator": self.aggregator.state_dict() if self.aggregator is not None else None,
        }
        last = self.state.last_eval
        score = last["pass@1"] if last and last.get("step") == step else None
        root = self.run_dir / "checkpoints"
        path = save_checkpoint(root, step, self.trainer.unwrapped, self.tok, payload, eval_score=score)
        self.tracker.register_checkpoint(path, step, score)
        apply_retention(root, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_best)
        return path

    def finish(self, **extra) -> dict:
        """Write summary.json (extra keys, e.g. the Prefect flow-run id, are added to it) and mark finished."""
        summary = {**run_summary(self.cfg, self.run_dir, self.state, time.perf_counter() - self.started), **extra}
        summary.update(self.tracker.info())  # e.g. mlflow_run_id
        write_json(self.run_dir / "summary.json", summary)
        self.tracker.log_artifact(self.run_dir / "summary.json")
        write_status(self.run_dir, "finished", step=self.state.step)
        self.tracker.finish("FINISHED")
        return summary

    def _eval_report(self, step: int) -> dict:
        cfg = self.cfg
        report = evaluate(
            self.backend,
            self.eval_rows,
            cfg.eval,
            cfg.rollout,
            self.verifiers,
            cfg.reward.weights,
            seed=cfg.seed + step,
        )
        report["step"] = step
        path = self.run_dir / "eval" / f"{step_dir_name(step)}.json"
        write_json(path, report)
        self.tracker.log_artifact(path, "eval")
        return report


# ---------------------------------------------------------------- stage helpers


def _columns(rows: list[dict], group_size: int, hidden: tuple[str, ...] = ()) -> dict[str, list]:
    """Data columns repeated G times so each completion sees its prompt's reference values."""
    keys = [k for k in rows[0] if k not in ("prompt", "model_input", *hidden)]
    return {k: [r[k] for r in rows for _ in range(group_size)] for k in keys}


def eval_metrics(report: dict) -> dict[str, float]:
    keys = [k for k in report if k.startswith("pass@") or k == "mean_reward"]
    return {f"eval/{k}": report[k] for k in keys}


def _step_metrics(ro: Rollouts, batch: ScoredBatch, stats: UpdateStats, times: dict[str, float]) -> dict[str, float]:
    lengths = ro.completion_mask.sum(1).float()  # [N]
    tokens = float(lengths.sum())
    m = {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()),
        "reward/frac_zero_std": frac_zero_std(batch.rewards, ro.group_size),
    }
    for name, mean in per_verifier_means(batch.verifier_names, batch.scores).items():
        m[f"reward/{name}/mean"] = mean
        m[f"reward/{name}/failures"] = float(batch.verifier_failures[name])
    m.update(
        {
            "completion/len_mean": float(lengths.mean()),
            "completion/len_max": float(lengths.max()),
            "completion/truncated_frac": sum(f == "length" for f in ro.finish_reasons) / len(ro.finish_reasons),
            "train/loss": stats.loss,
            "train/kl": stats.kl,
            "train/clip_frac_low": stats.clip_frac_low,
            "train/clip_frac_high": stats.clip_frac_high,
            "train/entropy": stats.entropy,
            "train/grad_norm": stats.grad_norm,
            "train/lr": stats.lr,
            "train/lr_scale": stats.lr_scale,
            "train/advantage_abs_mean": float(batch.advantages.abs().mean()),
            "policy/version": float(stats.policy_version),
            "perf/rollout_tokens_per_s": tokens / max(times["rollout"], 1e-9),
            "perf/update_tokens_per_s": stats.tokens * 1.0 / max(times["update"], 1e-9),
        }
    )
    m.update({f"time/{k}_s": v for k, v in times.items()})
    return m


# ---------------------------------------------------------------- checkpoint / resume


def _restore(
    run_dir: Path, trainer: Trainer | RemoteTrainer, sampler: PromptSampler, jsonl: JsonlTracker, aggregator
) -> RunState:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise UserError(f"cannot resume '{run_dir}': it has no checkpoint yet; start it again without --resume")
    saved = load_state(ckpt)
    trainer.restore(ckpt, saved["trainer"])  # weights + optimizer on every update process
    sampler.load_state_dict(saved["sampler"])
    set_rng_state(saved["rng"])
    if aggregator is not None and saved.get("aggregator") is not None:
        aggregator.load_state_dict(saved["aggregator"])
    jsonl.truncate_after(saved["step"])
    truncate_samples(run_dir, saved["step"])
    return RunState(
        step=saved["step"], seconds=saved["seconds"], initial_eval=saved["initial_eval"], last_eval=saved["last_eval"]
    )


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)
