"""GRPO, top to bottom: prep → [rollout → reward → advantages → update → (evaluate, checkpoint)] × steps.

Runnable without Prefect: `run(cfg, run_dir)` does the whole job and returns the summary. The flows call the
same stage functions one by one. Variants (Dr. GRPO, DAPO, GSPO, CISPO, RLOO advantages) are config choices
of the components (`forge.losses`, `forge.advantages`), not branches in this loop.

Run directory (the contract other tools read): config.yaml, status.json, data/{train,eval}.parquet,
data/manifest.json, metrics.jsonl, samples.jsonl, eval/step-NNNNNN.json, checkpoints/step-NNNNNN/ +
checkpoints/latest, and summary.json only once the run has finished.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forge.advantages import frac_zero_std, group_advantages
from forge.checkpoint import (apply_retention, latest_checkpoint, load_state, load_weights, save_checkpoint,
                              set_rng_state, step_dir_name)
from forge.config import RunConfig, dump_yaml
from forge.data import PromptSampler, prepare, read_split
from forge.errors import UserError
from forge.evaluate import evaluate
from forge.io import atomic_write_text, write_json
from forge.models import format_prompt_fn, load_policy
from forge.records import Rollouts, ScoredBatch, UpdateStats
from forge.rewards.registry import resolve_verifiers
from forge.rewards.score import RewardResult, per_verifier_means, score_completions
from forge.rollout import SamplingParams, make_backend
from forge.tracking import JsonlTracker, MultiTracker, Tracker
from forge.trainer import Trainer

STAGES = ("rollout", "reward", "update", "evaluate")
SAMPLES_PER_STEP = 8


@dataclass
class RunState:
    """Everything the loop carries between steps (and restores on resume)."""

    step: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    initial_eval: dict | None = None
    last_eval: dict | None = None


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, tracker: Tracker | None = None,
        progress: bool = True) -> dict:
    """Train with GRPO and return summary.json's content. Raises UserError for problems a user can fix."""
    cfg.validate()
    started = time.perf_counter()
    run_dir = Path(run_dir)
    _claim_run_dir(run_dir, resume)
    jsonl = JsonlTracker(run_dir)
    tracker = MultiTracker(jsonl, tracker) if tracker else jsonl
    try:
        summary = _train(cfg, run_dir, resume, tracker, jsonl, progress, started)
    except BaseException as e:
        _write_status(run_dir, "failed", error=f"{type(e).__name__}: {e}")
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    return summary


def _train(cfg, run_dir, resume, tracker, jsonl, progress, started) -> dict:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model, tok = load_policy(cfg.model, seed=cfg.seed)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.beta > 0 else None
    fmt = format_prompt_fn(tok, cfg.model)
    if not resume:
        atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
        prepare(cfg, run_dir, fmt, lambda s: len(tok(s, add_special_tokens=False).input_ids))
    train_rows, eval_rows = read_split(run_dir, "train"), read_split(run_dir, "eval")
    sampler = PromptSampler(train_rows, seed=cfg.seed)
    verifiers = resolve_verifiers(cfg.reward.verifiers)
    trainer = Trainer(model, cfg, total_steps=cfg.steps, ref_model=ref_model)
    backend = make_backend(cfg.rollout.backend, trainer.unwrapped, tok, autocast_bf16=cfg.rollout.autocast_bf16)
    state = RunState()
    tracker.log_params(_flatten(json.loads(json.dumps(_asdict(cfg)))))

    if resume:
        state = _restore(run_dir, trainer, sampler, jsonl)
        backend.sync_weights(trainer.unwrapped, trainer.policy_version)
    else:
        state.initial_eval = state.last_eval = _evaluate(backend, eval_rows, cfg, verifiers, 0, run_dir, state)
        tracker.log_metrics(_eval_metrics(state.initial_eval), step=0)
    _write_status(run_dir, "running", step=state.step)

    bar = _progress_bar(cfg.steps, state.step, progress)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, n=cfg.rollout.group_size)
    for step in range(state.step + 1, cfg.steps + 1):
        # 1. rollout: G samples for each of B prompts, from the current policy version
        rows = sampler.next_batch(cfg.rollout.prompts_per_step)
        t0 = time.perf_counter()
        rollouts = backend.generate([r["model_input"] for r in rows], params)
        assert rollouts.policy_version == trainer.policy_version, "rollout used stale weights"
        # 2. reward: every verifier scores every completion; weighted sum -> group-relative advantages
        t1 = time.perf_counter()
        result = score_completions(verifiers, cfg.reward.weights, rollouts.prompts, rollouts.texts,
                                   _columns(rows, cfg.rollout.group_size))
        advantages = group_advantages(result.rewards, cfg.rollout.group_size, cfg.algo.advantage)  # [N]
        batch = ScoredBatch(rollouts=rollouts, verifier_names=result.names, scores=result.scores,
                            rewards=result.rewards, advantages=advantages, verifier_failures=result.failures)
        # 3. update: PPO-style passes over the batch; the backend then samples from the new weights
        t2 = time.perf_counter()
        stats = trainer.update(batch)
        backend.sync_weights(trainer.unwrapped, trainer.policy_version)
        t3 = time.perf_counter()
        times = {"rollout": t1 - t0, "reward": t2 - t1, "update": t3 - t2}
        metrics = _step_metrics(rollouts, result, batch, stats, times)
        # 4. evaluate and checkpoint on schedule
        if _due(step, cfg.eval.every, cfg.steps):
            state.last_eval = _evaluate(backend, eval_rows, cfg, verifiers, step, run_dir, state)
            metrics.update(_eval_metrics(state.last_eval))
            times["evaluate"] = state.last_eval["seconds"]
        for k, v in times.items():
            state.seconds[k] += v
        state.step = step
        tracker.log_metrics(metrics, step=step)
        _append_samples(run_dir, step, rows, batch)
        if _due(step, cfg.checkpoint.every, cfg.steps):
            _checkpoint(run_dir, step, trainer, tok, sampler, state, cfg)
        _write_status(run_dir, "running", step=step)
        _update_bar(bar, metrics, state)
    if bar is not None:
        bar.close()
    summary = _summary(cfg, run_dir, state, time.perf_counter() - started)
    write_json(run_dir / "summary.json", summary)
    _write_status(run_dir, "finished", step=state.step)
    return summary


# ---------------------------------------------------------------- stage helpers


def _columns(rows: list[dict], group_size: int) -> dict[str, list]:
    """Data columns repeated G times so each completion sees its prompt's reference values."""
    keys = [k for k in rows[0] if k not in ("prompt", "model_input")]
    return {k: [r[k] for r in rows for _ in range(group_size)] for k in keys}


def _evaluate(backend, eval_rows, cfg: RunConfig, verifiers, step: int, run_dir: Path, state: RunState) -> dict:
    report = evaluate(backend, eval_rows, cfg.eval, cfg.rollout, verifiers, cfg.reward.weights, seed=cfg.seed + step)
    report["step"] = step
    write_json(run_dir / "eval" / f"{step_dir_name(step)}.json", report)
    state.seconds["evaluate"] += report["seconds"] if step == 0 else 0.0
    return report


def _eval_metrics(report: dict) -> dict[str, float]:
    keys = [k for k in report if k.startswith("pass@") or k == "mean_reward"]
    return {f"eval/{k}": report[k] for k in keys}


def _step_metrics(ro: Rollouts, result: RewardResult, batch: ScoredBatch, stats: UpdateStats,
                  times: dict[str, float]) -> dict[str, float]:
    lengths = ro.completion_mask.sum(1).float()  # [N]
    tokens = float(lengths.sum())
    m = {"reward/mean": float(result.rewards.mean()), "reward/std": float(result.rewards.std()),
         "reward/frac_zero_std": frac_zero_std(result.rewards, ro.group_size)}
    for name, mean in per_verifier_means(result).items():
        m[f"reward/{name}/mean"] = mean
        m[f"reward/{name}/failures"] = float(result.failures[name])
    m.update({"completion/len_mean": float(lengths.mean()), "completion/len_max": float(lengths.max()),
              "completion/truncated_frac": sum(f == "length" for f in ro.finish_reasons) / len(ro.finish_reasons),
              "train/loss": stats.loss, "train/kl": stats.kl, "train/clip_frac_low": stats.clip_frac_low,
              "train/clip_frac_high": stats.clip_frac_high, "train/entropy": stats.entropy,
              "train/grad_norm": stats.grad_norm, "train/lr": stats.lr, "train/lr_scale": stats.lr_scale,
              "train/advantage_abs_mean": float(batch.advantages.abs().mean()),
              "policy/version": float(stats.policy_version),
              "perf/rollout_tokens_per_s": tokens / max(times["rollout"], 1e-9),
              "perf/update_tokens_per_s": stats.tokens * 1.0 / max(times["update"], 1e-9)})
    m.update({f"time/{k}_s": v for k, v in times.items()})
    return m


def _append_samples(run_dir: Path, step: int, rows: list[dict], batch: ScoredBatch) -> None:
    """A few completions per step (the first group) with their per-verifier scores, for inspection."""
    ro, g = batch.rollouts, batch.rollouts.group_size
    lines = []
    for i in range(min(SAMPLES_PER_STEP, ro.num_completions)):
        scores = {n: _num(batch.scores[i, v]) for v, n in enumerate(batch.verifier_names)}
        lines.append(json.dumps({"step": step, "prompt": rows[i // g]["prompt"], "answer": rows[i // g].get("answer"),
                                 "completion": ro.texts[i], "scores": scores, "reward": _num(batch.rewards[i]),
                                 "advantage": _num(batch.advantages[i])}))
    with (run_dir / "samples.jsonl").open("a") as f:
        f.write("\n".join(lines) + "\n")


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------- checkpoint / resume


def _checkpoint(run_dir, step, trainer: Trainer, tok, sampler, state: RunState, cfg: RunConfig) -> None:
    payload = {"trainer": trainer.state_dict(), "sampler": sampler.state_dict(), "seconds": dict(state.seconds),
               "initial_eval": state.initial_eval, "last_eval": state.last_eval}
    score = state.last_eval["pass@1"] if state.last_eval and state.last_eval.get("step") == step else None
    root = run_dir / "checkpoints"
    save_checkpoint(root, step, trainer.unwrapped, tok, payload, eval_score=score)
    apply_retention(root, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best)


def _restore(run_dir: Path, trainer: Trainer, sampler: PromptSampler, jsonl: JsonlTracker) -> RunState:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise UserError(f"cannot resume '{run_dir}': it has no checkpoint yet; start it again without --resume")
    saved = load_state(ckpt)
    load_weights(trainer.unwrapped, ckpt)
    trainer.load_state_dict(saved["trainer"])
    sampler.load_state_dict(saved["sampler"])
    set_rng_state(saved["rng"])
    jsonl.truncate_after(saved["step"])
    _truncate_samples(run_dir, saved["step"])
    return RunState(step=saved["step"], seconds=saved["seconds"], initial_eval=saved["initial_eval"],
                    last_eval=saved["last_eval"])


def _truncate_samples(run_dir: Path, step: int) -> None:
    path = run_dir / "samples.jsonl"
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if _line_step(line) <= step]
        atomic_write_text(path, "".join(line + "\n" for line in keep))


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 30


# ---------------------------------------------------------------- run directory bookkeeping


def _claim_run_dir(run_dir: Path, resume: bool) -> None:
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"cannot resume '{run_dir}': no such run (config.yaml missing)")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"run directory '{run_dir}' already exists: pass --resume to continue it or choose another --name")
    run_dir.mkdir(parents=True, exist_ok=True)


def _write_status(run_dir: Path, state: str, step: int = 0, error: str = "") -> None:
    status = {"state": state, "step": step, "updated": time.time()}
    if error:
        status["error"] = error
    write_json(run_dir / "status.json", status)


def _summary(cfg: RunConfig, run_dir: Path, state: RunState, wall: float) -> dict:
    def brief(report):
        return {k: v for k, v in (report or {}).items() if k.startswith("pass@") or k in ("step", "mean_reward")}

    seconds = {**{k: round(v, 3) for k, v in state.seconds.items()}, "total": round(wall, 3)}
    return {"run": run_dir.name, "preset": cfg.preset, "model": cfg.model.path, "steps": state.step,
            "run_dir": str(run_dir.resolve()), "eval": {"initial": brief(state.initial_eval),
                                                         "final": brief(state.last_eval)}, "seconds": seconds}


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _asdict(cfg: RunConfig) -> dict:
    from dataclasses import asdict

    return asdict(cfg)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _progress_bar(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="grpo", unit="step", dynamic_ncols=True)


def _update_bar(bar, metrics: dict, state: RunState) -> None:
    if bar is None:
        return
    post = {"reward": f"{metrics['reward/mean']:.3f}"}
    if state.last_eval:
        post["eval_pass@1"] = f"{state.last_eval['pass@1']:.3f}"
    bar.set_postfix(post)
    bar.update(1)
