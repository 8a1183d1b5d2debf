"""Run-directory bookkeeping shared by the recipes: claim, lock, status.json, samples.jsonl, run tags, progress bar.

One process per run directory: `RunLock` holds an exclusive `fcntl.flock` on `<run>/.lock` for as long as the
run is going (the kernel drops it when the process dies, SIGKILL included); the lock file names the holder's pid
and host. A second process on the same directory (a second `--resume`, a resume while it still runs) is refused
with a one-line error naming that pid, before it writes anything. flock is per machine: on a filesystem shared
by several hosts it may not exclude a process on another host (see docs/hardening.md).

status.json says running / failed (with the error) / finished, with the pid and host of the process and a
heartbeat (rewritten every HEARTBEAT_S seconds while the run holds its lock); `run_status` reads it and reports a
"running" run whose lock nobody holds as stale (its process died without finishing). summary.json is written only
on completion, so a half-written run never looks complete. samples.jsonl keeps a few completions per step for inspection
(multi-turn: with each episode's transcript, and its turns, tool calls, tool errors and whether a limit cut it).
`track_run_start` hands a tracker what identifies a run: tags (preset, model, dataset hash, git commit), the
flattened config as params, and config.yaml / plan.json / data/manifest.json as artifacts. Params are the config
the run started with (MLflow's are immutable); what a resume changed is in config_changes.jsonl and a tag per
such resume, `forgeweave.config_changes.step-NNNNNN` = `{"key": [old, new], ...}`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forge.advantages import per_completion
from forge.errors import UserError
from forge.io import append_text, atomic_write_text, truncate_jsonl, write_json
from forge.metrics import sampled_versions
from forge.records import SAMPLES_PER_STEP, Episodes, Rollouts, ScoredBatch, TokenSequence
from forge.tracking import Tracker

if TYPE_CHECKING:
    from forge.rewards.teacher import TeacherScores

LOCK = ".lock"
CHANGES = "config_changes.jsonl"  # one line per resume that changed the config (forge.compose.record_changes)
INPUTS = "inputs"  # datasets given to forge.train as objects, saved here before the run starts (forge/api.py)
HEARTBEAT_S = 30.0
TokenText = Callable[[list[int]], list[str]]  # token ids -> each token's text, decoded alone


def append_samples(run_dir: Path, step: int, rows: list[dict], ro: Rollouts, batch: ScoredBatch, *,
                   trainer_version: int | None = None, token_text: TokenText | None = None,
                   teacher: TeacherScores | None = None, gaps: tuple = ()) -> list[dict]:  # fmt: skip
    """A few completions per step (the first SAMPLES_PER_STEP rows: the first group) with their per-verifier scores,
    appended to samples.jsonl; returns them for the tracker's sample table, without their `tokens`.

    Each line also says whether its group's rewards were all equal (`zero_std_group`: no learning signal), the
    oldest policy version that sampled it (`policy_version`) and, given `trainer_version` (the trainer's version
    when the step's rollouts were checked), its `staleness` in versions; its `tokens` (`token_record`) are what
    the dashboard's token view shows (distilling, with the `teacher`'s log-ratio per sampled token; given the
    update's `gaps`, `UpdateStats.logprob_gaps`, the trainer's log-prob gap to the sampler per token). On a step
    where a verifier erred, each line also says how many items it erred on and its first error text."""
    g = ro.group_size
    errors = {n: {"items": batch.verifier_errored.get(n, 0), "first": e} for n, e in batch.verifier_errors.items()}
    flat = batch.rewards.view(-1, g)  # [B, G]
    zero_std = (flat.max(dim=1).values == flat.min(dim=1).values).tolist()  # [B] as forge.advantages.frac_zero_std
    versions = sampled_versions(ro)
    samples, advantages = [], per_completion(batch.advantages, ro.loss_mask)  # [N]: per-token ones averaged
    for i in range(min(SAMPLES_PER_STEP, ro.num_completions)):
        scores = {n: _num(batch.scores[i, v]) for v, n in enumerate(batch.verifier_names)}
        version = versions[i] if ro.episodes is not None else versions[0]  # single-turn: one for the batch
        samples.append(
            {
                "step": step,
                "prompt": rows[i // g]["prompt"],
                "answer": rows[i // g].get("answer"),
                "completion": ro.texts[i],
                "scores": scores,
                "reward": _num(batch.rewards[i]),
                "advantage": _num(advantages[i]),
                "zero_std_group": bool(zero_std[i // g]),
                "policy_version": version,
                **({"staleness": trainer_version - version} if trainer_version is not None else {}),
                **({"verifier_errors": errors} if errors else {}),  # the step's first error per verifier
                **(_episode_sample(ro.episodes, i) if ro.episodes is not None else {}),  # multi-turn
                **({"env_failure": failure} if (failure := _failure(ro, i)) else {}),  # its environment failed
                "tokens": token_record(ro, batch.advantages, i, token_text, teacher, _row(gaps, i)),
            }
        )
    append_text(run_dir / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    return [{k: v for k, v in s.items() if k != "tokens"} for s in samples]


def token_record(ro: Rollouts, advantages: torch.Tensor, i: int, token_text: TokenText | None = None,
                 teacher: TeacherScores | None = None, gap: tuple[float, ...] | None = None) -> dict:  # fmt: skip
    """Row i's tokens after the prompt (its real ones: sampled, and what the environment, tools or agent added), as
    parallel lists: `ids`; `text`, each token decoded alone (given `token_text`; a character split across tokens
    shows as U+FFFD); `loss`, the loss mask (1 on sampled tokens; all 0 in an episode taken out of the loss);
    `logprob`, the sampling log-prob (0 off the sampled tokens); `advantage` only where `advantages` is per token
    ([N, T]; a row's one advantage is the sample's `advantage`); `teacher`, given the teacher stage's scores, its
    log-ratio log p_teacher - log p_sampler on the sampled tokens (the distillation reward; 0 elsewhere); `gap`,
    given the update's per-token gap of this row, log pi_old - log mu: the trainer's log-prob of each sampled token
    (before the step's update) less the sampler's (0 elsewhere; a policy lag adds to it off policy); `more`, for
    an episode whose agent rewrote its history, the training sequences after the first (`_sequence_record`). Floats
    to 4 decimals, None where not finite.

    >>> ro = Rollouts(torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]),
    ...               torch.tensor([[-0.12345, 0.0, 0.0]]), ["ab"], ["stop"], 1, 0, loss_mask=torch.tensor([[1, 0, 0]]))
    >>> token_record(ro, torch.zeros(1), 0, lambda ids: [chr(92 + t) for t in ids])
    {'ids': [5, 6], 'loss': [1, 0], 'logprob': [-0.1235, 0.0], 'text': ['a', 'b']}
    >>> token_record(ro, torch.zeros(1), 0, gap=(0.25, float("nan")))["gap"]
    [0.25, None]
    """
    real = ro.completion_mask[i].bool().cpu()  # [T]; on the CPU whatever device each tensor is on
    ids = ro.completion_ids[i].cpu()[real].tolist()
    out = {"ids": ids, "loss": ro.loss_mask[i].cpu()[real].int().tolist(),
           "logprob": _floats(ro.sampling_logprobs[i].cpu()[real])}  # fmt: skip
    if token_text is not None:
        out["text"] = token_text(ids)
    if advantages.dim() == 2:  # [N, T] per token (e.g. a teacher's dense term)
        out["advantage"] = _floats(advantages[i].cpu()[real])
    if teacher is not None:
        ratio = (teacher.logp[i].cpu() - ro.sampling_logprobs[i].cpu()) * ro.loss_mask[i].cpu()
        out["teacher"] = _floats(ratio[real])
    if gap is not None and len(gap) == len(ids):
        out["gap"] = _floats(torch.tensor(gap, dtype=torch.float64))
    more = ro.episodes.more_sequences if ro.episodes is not None else []
    if i < len(more) and more[i]:  # an agent rewrote its history: the training sequences after the first
        out["more"] = [_sequence_record(seq, token_text) for seq in more[i]]
    return out


def _sequence_record(seq: TokenSequence, token_text: TokenText | None) -> dict:
    """A further training sequence of an episode as `token_record` lists, with `prompt_tokens`, its prompt's length
    (what the agent sent as its rewritten history)."""
    out = {"prompt_tokens": len(seq.prompt_ids), "ids": list(seq.ids), "loss": list(seq.loss),
           "logprob": _floats(torch.tensor(seq.logprobs, dtype=torch.float32))}  # fmt: skip
    if token_text is not None:
        out["text"] = token_text(out["ids"])
    return out


def _row(rows: tuple, i: int):
    return rows[i] if i < len(rows) else None


def _floats(x: torch.Tensor) -> list[float | None]:
    return [round(v, 4) if math.isfinite(v) else None for v in x.float().tolist()]


def _episode_sample(e: Episodes, i: int) -> dict:
    """Episode i's transcript (segments in order) and its figures: policy turns, tool calls, tool errors, whether a
    limit cut it and whether it is out of the loss (the dashboard and the MLflow sample table show them beside the
    transcript)."""
    figures = {"turns": e.turns[i], "tool_calls": e.tool_calls[i], "tool_errors": e.tool_errors[i]}
    masked = {"masked": e.masked[i]} if e.masked else {}  # out of the loss: its `tokens.loss` is all 0
    return {"transcript": e.transcripts[i], "episode": {**figures, "truncated": e.truncated[i], **masked}}


def _failure(ro: Rollouts, i: int) -> str:
    """Why episode i's environment failed ('' = it did not, or single-turn)."""
    return ro.episodes.failures[i] if ro.episodes is not None and ro.episodes.failures else ""


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def truncate_samples(run_dir: Path, step: int) -> None:
    truncate_jsonl(run_dir / "samples.jsonl", step)  # the lines kept are byte for byte what was written


def check_run_name(name: str) -> str:
    """`name` if it can be a run directory under the runs dir: one path component, no '..', not hidden."""
    ok = bool(name) and name not in (".", "..") and not name.startswith(".") and "/" not in name
    ok = ok and "\\" not in name and "\x00" not in name and len(name) <= 200
    if not ok:
        raise UserError(
            f"run name {name!r} is not a plain directory name (no '/', '..', leading '.', absolute paths): "
            "pass --name my-run and --runs-dir for where runs live"
        )
    return name


def default_run_dir(preset: str) -> Path:
    """`$FORGEWEAVE_RUNS_DIR` (or ./runs) / `<preset>-<time>` (`run-<time>` without a preset)."""
    runs = Path(os.environ.get("FORGEWEAVE_RUNS_DIR", "runs"))
    return runs / check_run_name(f"{preset or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")


def claim_run_dir(run_dir: Path, resume: bool) -> None:
    """`check_run_dir`, then create the directory when new."""
    check_run_dir(run_dir, resume)
    if resume:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create run directory '{run_dir}' ({e.strerror}): check --runs-dir") from None


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Check `run_dir` can be started (new: absent or empty but for its lock and forge.train's inputs/) or resumed;
    reads only. The CLI calls it before a flow starts, so a taken name is one line, not a failed flow run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory '{run_dir}' is a file, not a directory: choose another --name")
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"cannot resume '{run_dir}': no such run (config.yaml missing)")
        return
    if run_dir.exists() and any(p.name not in (LOCK, INPUTS) for p in run_dir.iterdir()):
        raise UserError(
            f"run directory '{run_dir}' already exists: pass --resume to continue it or choose another --name"
        )


class RunLock:
    """The exclusive lock of one run directory for this process (re-entrant: the CLI and the recipe may both hold
    it); `release` when the run is over. Also keeps status.json's heartbeat fresh."""

    _held: dict[str, RunLock] = {}

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd, self.depth = run_dir, fd, 1
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="forgeweave-heartbeat", daemon=True)
        self._beat.start()

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        key = str(Path(run_dir).resolve())
        if key in cls._held:
            cls._held[key].depth += 1
            return cls._held[key]
        path = Path(run_dir) / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot open the lock file '{path}' ({e.strerror}): is the runs dir writable?") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock '{path}' ({e.strerror})") from None
            raise UserError(
                f"run directory '{run_dir}' is in use by process {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}: wait for it to finish or stop it (kill {holder.get('pid', 'PID')})"
            ) from None
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder + "\n").encode(), 0)
        lock = cls._held[key] = cls(Path(run_dir), fd)
        return lock

    def release(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        self._stop.set()
        self._held.pop(str(self.run_dir.resolve()), None)
        os.close(self.fd)  # drops the flock

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            # read and write under the lock: a "failed" or "finished" written between the two must not be
            # overwritten with the "running" read before it
            with _status_lock:
                last = _last_status.get(str(self.run_dir))
                if last is not None and last.get("state") == "running":
                    try:
                        write_json(self.run_dir / "status.json", {**last, "heartbeat": time.time()})
                    except OSError:  # a full disk: the loop's own writes report it
                        pass


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def lock_holder(run_dir: Path) -> dict | None:
    """Who holds the run directory's lock now ({"pid", "host", ...}; this process included), or None. Read-only."""
    if str(Path(run_dir).resolve()) in RunLock._held:
        return {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError:
        return _read_holder(fd)
    finally:
        os.close(fd)


def lock_is_held(run_dir: Path) -> bool:
    return lock_holder(run_dir) is not None


def refuse_if_locked(run_dir: Path) -> None:
    """Raise the 'in use by process PID' UserError if another process holds the run's lock (writes nothing)."""
    holder = lock_holder(run_dir)
    if holder is not None and str(Path(run_dir).resolve()) not in RunLock._held:
        pid = holder.get("pid", "?")
        raise UserError(f"run directory '{run_dir}' is in use by process {pid} on {holder.get('host', '?')}: "
                        f"wait for it to finish or stop it (kill {pid})")  # fmt: skip


_last_status: dict[str, dict] = {}
_status_lock = threading.Lock()


def write_guard_log(run_dir: Path, events: list[dict]) -> None:
    """guard.jsonl := the collapse guard's firings, one JSON object a line (rewritten whole, atomically: after a
    resume it holds those up to the checkpoint); not created while nothing has fired."""
    path = Path(run_dir) / "guard.jsonl"
    if events or path.exists():
        atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in events))


def write_status(run_dir: Path, state: str, step: int = 0, error: str = "") -> None:
    """status.json: state, step, this process's pid and host, when (updated; heartbeat) and the error, if any."""
    now = time.time()
    status = {"state": state, "step": step, "pid": os.getpid(), "host": socket.gethostname(), "updated": now,
              "heartbeat": now}  # fmt: skip
    if error:
        status["error"] = error
    with _status_lock:
        _last_status[str(run_dir)] = status
        write_json(run_dir / "status.json", status)


def run_status(run_dir: Path) -> dict:
    """status.json's content (state "unknown" if absent or unreadable), with `stale`: it says running but no
    process holds the run's lock (the process was killed; `--resume` continues it)."""
    try:
        status = json.loads((Path(run_dir) / "status.json").read_text())
        status = status if isinstance(status, dict) else {"state": "unknown"}
    except (OSError, ValueError):
        status = {"state": "unknown"}
    status["stale"] = status.get("state") == "running" and not lock_is_held(run_dir)
    return status


def note_stale(run_dir: Path) -> None:
    """Say on stderr when the run's last process died without finishing (status.json still says running)."""
    last = run_status(run_dir)
    if last.get("stale"):
        print(f"forgeweave: {run_dir.name}: its last process ({last.get('pid', '?')} on {last.get('host', '?')}) "
              f"stopped at step {last.get('step')} without finishing; resuming", file=sys.stderr, flush=True)  # fmt: skip


def track_run_start(tracker: Tracker, run_dir: Path, config: dict, *, preset: str, model: str) -> None:
    """Tags, params (`config`: the resolved config as a nested dict, flattened) and the run's defining files, for
    the tracker; `preset`, `model`: the config's preset name and model.path (tags)."""
    changes = read_changes(run_dir)
    tracker.set_tags(run_tags(run_dir, preset=preset, model=model) | change_tags(changes))
    tracker.log_params(started_params(flatten(config), changes))
    for name, where in (("config.yaml", ""), ("plan.json", ""), ("data/manifest.json", "data")):
        if (run_dir / name).is_file():
            tracker.log_artifact(run_dir / name, where)


def read_changes(run_dir: Path) -> list[dict]:
    """config_changes.jsonl's records, oldest first (none when no resume changed the config)."""
    path = Path(run_dir) / CHANGES
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def change_tags(changes: list[dict]) -> dict[str, str]:
    """One tag per resume that changed the config: `forgeweave.config_changes.step-NNNNNN` -> its changes (JSON)."""
    return {f"forgeweave.config_changes.step-{c['step']:06d}": json.dumps(c["changes"]) for c in changes}


def started_params(params: dict, changes: list[dict]) -> dict:
    """The flattened config as the run started: each key a resume changed goes back to its first old value.

    >>> started_params({"update.lr": 0.5, "steps": 9}, [{"changes": {"update.lr": [1.0, 0.7]}},
    ...                                                  {"changes": {"update.lr": [0.7, 0.5]}}])
    {'update.lr': 1.0, 'steps': 9}
    """
    first: dict = {}
    for c in changes:
        for key, (old, _new) in c["changes"].items():
            first.setdefault(key, old)
    return {k: first.get(k, v) for k, v in params.items()}


def run_tags(run_dir: Path, *, preset: str, model: str) -> dict[str, str]:
    try:
        manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    tags = {
        "forgeweave.run_name": run_dir.name,
        "forgeweave.run_dir": str(run_dir.resolve()),
        "forgeweave.preset": preset,
        "forgeweave.model": model,
        "forgeweave.dataset_hash": manifest.get("content_hash", ""),
    }
    commit = git_commit()
    if commit:
        tags.update({"forgeweave.git_commit": commit, "mlflow.source.git.commit": commit})
    return tags


def git_commit() -> str:
    """The commit of the forgeweave checkout this code runs from; "" when it is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def progress_bar(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="grpo", unit="step", dynamic_ncols=True)


def update_bar(bar, reward: float | None, last_eval: dict | None) -> None:
    if bar is None:
        return
    post = {"reward": f"{reward:.3f}" if reward is not None else "-"}
    if last_eval:
        post["eval_pass@1"] = f"{last_eval['pass@1']:.3f}"
    bar.set_postfix(post)
    bar.update(1)


def run_summary(run_dir: Path, state, wall: float, *, preset: str, model: str) -> dict:
    """summary.json's content: `state` is the loop's `forge.loop.LoopState` (step, seconds, initial/last eval);
    `preset`, `model`: the config's preset name and model.path."""

    def brief(report):
        keep = ("step", "problems", "mean_reward", "first_turn@1", "final_turn@1", "mean_turns")  # last 3: multi-turn
        return {k: v for k, v in (report or {}).items() if k.startswith("pass@") or k in keep}

    seconds = {**{k: round(v, 3) for k, v in state.seconds.items()}, "total": round(wall, 3)}
    return {
        "run": run_dir.name,
        "preset": preset,
        "model": model,
        "steps": state.step,
        "run_dir": str(run_dir.resolve()),
        "eval": {"initial": brief(state.initial_eval), "final": brief(state.last_eval)},
        "seconds": seconds,
    }
