"""The metrics of a GRPO step, namespaced (`reward/`, `completion/`, `train/`, `rollout/`, `perf/`, `time/`, `eval/`,
`probe/`), computed from the stage records the loop in `forge.recipes.grpo` passes along; `Stopwatch` times its
stages."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence

from forge.advantages import advantage_mass, frac_zero_std
from forge.records import Rollouts, ScoredBatch, UpdateStats
from forge.rewards.score import per_verifier_means


def eval_metrics(report: dict) -> dict[str, float]:
    """An eval report's pass@k, mean reward and (multi-turn) first / final turn success as `eval/...` metrics."""
    keys = [k for k in report if k.startswith("pass@") or k in ("mean_reward", "first_turn@1", "final_turn@1")]
    return {f"eval/{k}": report[k] for k in keys}


def probe_metrics(report: dict) -> dict[str, float]:
    """A probe report's greedy pass@1 and mean reward as `probe/...` metrics (the collapse guard's input)."""
    return {f"probe/{k}": report[k] for k in ("pass@1", "mean_reward") if k in report}


def step_metrics(ro: Rollouts, batch: ScoredBatch, stats: UpdateStats, times: dict[str, float], wall: float = 0.0,
                 staleness: Sequence[int] = (0,)) -> dict[str, float]:  # fmt: skip
    """A step's rewards, completions, update figures, stage seconds (`times`: stage -> seconds), the off-policy and
    overlap figures (`wall`: the step's seconds; `staleness`: `checked_staleness`'s) and, on a refit step, the
    label-free ensemble's."""
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
        m[f"reward/{name}/errors"] = float(batch.verifier_errored.get(name, 0))
    m.update(batch.reward_metrics)  # e.g. reward/majority_share, reward/code_exec/suspicious
    if stats.teacher_kl is not None:  # the top-k reverse KL the update minimised (weighted), per sampled token
        m["distill/topk_kl"] = stats.teacher_kl
    m.update(
        {
            "completion/len_mean": float(lengths.mean()),
            "completion/len_max": float(lengths.max()),
            "completion/truncated_frac": sum(f == "length" for f in ro.finish_reasons) / len(ro.finish_reasons),
            "train/loss": stats.loss,
            "train/kl_old": stats.kl_old,  # approximate KL to the policy at the start of the update
            "train/kl_ref": stats.kl_ref,  # k3 KL to the reference policy (algo.beta > 0; else 0)
            "train/clip_frac_low": stats.clip_frac_low,
            "train/clip_frac_high": stats.clip_frac_high,
            "train/entropy": stats.entropy,
            "train/grad_norm": stats.grad_norm,
            "train/skipped_steps": float(stats.skipped),
            "train/lr": stats.lr,
            "train/lr_scale": stats.lr_scale,
            "train/advantage_abs_mean": advantage_mass(batch.advantages, ro.loss_mask),  # per token if [N, T]
            "policy/version": float(stats.policy_version),
            "perf/rollout_tokens_per_s": tokens / max(ro.seconds or times["rollout"], 1e-9),  # the sampler's time
            "perf/update_tokens_per_s": stats.tokens * 1.0 / max(times["update"], 1e-9),
        }
    )
    m.update({f"time/{k}_s": v for k, v in times.items()})
    m["perf/weight_sync_s"] = stats.sync_seconds  # new weights -> rollout workers; part of time/update_s
    m.update(overlap_metrics(ro, stats, wall, staleness))
    if ro.episodes is not None:
        m.update(episode_metrics(ro))
    if batch.ensemble_report is not None:
        from forge.rewards.aggregate import report_metrics

        m.update(report_metrics(batch.ensemble_report))
    return m


def episode_metrics(ro: Rollouts) -> dict[str, float]:
    """Multi-turn figures, means per episode: policy turns, tool calls, tool errors, share truncated by a limit,
    seconds in the environment and tools; the share of episode tokens the loss counts; `env/cut_frac`, the share of
    policy turns cut by rollout.max_new_tokens (no eos sampled); and `env/failed`, the number of episodes whose
    environment failed (an OpenEnv server gone, an agent that raised). Agent episodes (env.agent) add the requests
    and the prefix breaks (requests that rewrote the history: each begins a training sequence of its own) per
    episode, and the step's counts of requests answered with an error (`env/agent_refused`) and of episodes failed
    past env.agent.timeout_s (`env/agent_timed_out`, among `env/failed`)."""
    e, n = ro.episodes, max(ro.num_completions, 1)
    agent = {"env/agent_requests": sum(e.requests) / n, "env/agent_prefix_breaks": sum(e.prefix_breaks) / n,
             "env/agent_refused": float(sum(e.refused)), "env/agent_timed_out": float(sum(e.timed_out))}  # fmt: skip
    return ({} if not e.requests else agent) | {
        "env/failed": float(sum(bool(f) for f in e.failures)),
        "env/turns": sum(e.turns) / n,
        "env/tool_calls": sum(e.tool_calls) / n,
        "env/tool_errors": sum(e.tool_errors) / n,
        "env/truncated": sum(e.truncated) / n,
        "env/seconds": sum(e.seconds) / n,
        "env/sampled_frac": float(ro.loss_mask.sum()) / max(float(ro.completion_mask.sum()), 1.0),
        "env/cut_frac": sum(e.cut_turns) / max(sum(e.turns), 1),
    }


def overlap_metrics(ro: Rollouts, stats: UpdateStats, wall: float, staleness: Sequence[int]) -> dict[str, float]:
    """Off-policy and overlap figures of a step: staleness (over the batch, or per episode), sampler/trainer log-prob
    gap, idle shares."""
    idle = lambda busy: min(1.0, max(0.0, 1.0 - busy / max(wall, 1e-9)))  # noqa: E731
    return {
        "rollout/staleness_mean": sum(staleness) / len(staleness),
        "rollout/staleness_max": float(max(staleness)),
        "train/logprob_diff": stats.logprob_diff,
        "train/is_truncated_frac": stats.is_truncated_frac,
        "perf/rollout_idle_frac": idle(ro.seconds),  # the sampler's own seconds vs the step's wall time
        "perf/trainer_idle_frac": idle(stats.seconds),
        "perf/step_s": wall,
    }


def sampled_versions(ro: Rollouts) -> list[int]:
    """The oldest policy version behind each row of `ro`: a multi-turn episode's oldest turn (`Episodes.policy_versions`;
    with prefetching a whole episode runs on one version), else the batch's one version (a single entry)."""
    if ro.episodes is None:
        return [ro.policy_version]
    return [min(turns, default=ro.policy_version) for turns in ro.episodes.policy_versions]


def checked_staleness(step: int, trainer: int, sampled: list[int], cap: int) -> list[int]:
    """Policy versions between the trainer and each sampled version (`sampled_versions`; 0 on-policy); one outside
    [0, algo.max_staleness] is a bug, not a user mistake: RuntimeError.

    >>> checked_staleness(3, 5, [4, 5, 4], cap=1)
    [1, 0, 1]
    """
    staleness = [trainer - v for v in sampled]
    for version, stale in zip(sampled, staleness, strict=True):
        if not 0 <= stale <= cap:
            raise RuntimeError(
                f"step {step}: rollout used policy version {version}, trainer is at {trainer}: "
                f"{stale} versions stale, algo.max_staleness={cap}"
            )
    return staleness


def show_verifier_errors(batch: ScoredBatch, step: int, shown: frozenset) -> frozenset:
    """Print each verifier error text once per run on stderr; `shown`: the (verifier, text) pairs printed so far;
    returns them with this step's."""
    for name, text in batch.verifier_errors.items():
        if (name, text) not in shown:
            shown = shown | {(name, text)}
            n, bad = batch.scores.shape[0], batch.verifier_errored.get(name, 0)
            print(f"forgeweave: step {step}: verifier '{name}' erred on {bad} of {n} items: {error_line(text)}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return shown


def error_line(text: str, limit: int = 300) -> str:
    """A verifier's error text as one line of at most `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Stopwatch:
    """Seconds per stage of one step: `with clock("rollout"): ...`; `laps` maps stage -> seconds."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.laps[stage] = self.laps.get(stage, 0.0) + time.perf_counter() - t0
