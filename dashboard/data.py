"""Pure readers for run directories: what the dashboard shows, as plain records and pandas frames.

Nothing here imports streamlit or forge; every function takes paths or already-read rows, so the pages stay
thin and these are tested directly. Readers tolerate a run that is still being written: a missing file gives
None or an empty frame, a JSON file that does not parse gives None, and a torn or garbled line in a `.jsonl`
file (a writer killed mid-line, or caught mid-append) is skipped. They never write anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from dashboard import tokens, transcripts

STAGES = ("rollout", "reward", "update", "evaluate")
# files whose presence makes a directory under the runs dir a run (mlflow.db and artifact folders are not)
RUN_MARKERS = ("config.yaml", "status.json", "metrics.jsonl")
CHECKPOINT_TOTAL, CHECKPOINT_STALL = "time/checkpoint_s", "time/checkpoint_stall_s"
CHECKPOINT_NAMES = {CHECKPOINT_STALL: "checkpoint stall", CHECKPOINT_TOTAL: "checkpoint background"}
EPISODE_COLUMNS = ("turns", "tool calls", "tool errors", "truncated")  # a multi-turn sample's figures
# column -> samples.jsonl key: whether the sample's group had zero reward std (no learning signal), and how many
# policy versions the trainer was ahead of the one that sampled it
LAG_COLUMNS = {"zero-std group": "zero_std_group", "staleness": "staleness"}
TOKENS = "tokens recorded"  # samples_frame's column: the sample's line has a token record (not shown in the table)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing or not (yet) valid JSON."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_jsonl(path: Path) -> list[dict]:
    """One dict per well-formed line of `path`; a torn last line or any garbled line is skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_yaml(path: Path) -> dict | None:
    try:
        obj = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return obj if isinstance(obj, dict) else None


def find_runs(runs_dir: Path) -> list[Path]:
    """Run directories directly under `runs_dir` (those holding a config, status or metrics file), by name."""
    if not runs_dir.is_dir():
        return []
    return sorted(p for p in runs_dir.iterdir() if p.is_dir() and any((p / marker).is_file() for marker in RUN_MARKERS))


# ---------------------------------------------------------------- one run at a glance


@dataclass(frozen=True)
class RunOverview:
    """One row of the Runs page."""

    name: str  # run directory name (== MLflow run name)
    path: str  # absolute run directory
    state: str  # running / failed / finished (status.json), "unknown" before status.json exists
    step: int  # last completed step
    total_steps: int | None  # `steps` in config.yaml
    preset: str  # config preset ("" for a YAML config without one)
    model: str  # model.path of the config
    best_pass1: float | None  # highest eval/pass@1 logged so far (step 0 = the initial eval included)
    best_step: int | None  # the step that reached best_pass1
    last_pass1: float | None  # most recent eval/pass@1
    duration_s: float | None  # summary.json's total when finished, else the stage seconds logged so far
    updated: float | None  # unix time status.json was last written
    error: str  # the failure, for failed runs
    mlflow_run_id: str  # summary.json's mlflow_run_id when the tracker wrote one


def run_overview(run_dir: Path) -> RunOverview:
    """Read status.json, config.yaml, summary.json and metrics.jsonl of one run into a RunOverview."""
    status = read_json(run_dir / "status.json") or {}
    config = read_yaml(run_dir / "config.yaml") or {}
    summary = read_json(run_dir / "summary.json") or {}
    frame = metrics_frame(read_jsonl(run_dir / "metrics.jsonl"))
    best, best_step, last = eval_scores(frame)
    return RunOverview(
        name=run_dir.name,
        path=str(run_dir.resolve()),
        state=str(status.get("state", "unknown")),
        step=int(status.get("step", frame.index.max() if len(frame) else 0)),
        total_steps=_int_or_none(config.get("steps")),
        preset=str(summary.get("preset") or config.get("preset") or ""),
        model=str(summary.get("model") or (config.get("model") or {}).get("path", "")),
        best_pass1=best,
        best_step=best_step,
        last_pass1=last,
        duration_s=run_duration(summary, frame),
        updated=status.get("heartbeat", status.get("updated")),  # heartbeat: every 30 s while the run holds its lock
        error=str(status.get("error", "")),
        mlflow_run_id=str(summary.get("mlflow_run_id") or ""),
    )


def _int_or_none(v) -> int | None:
    return int(v) if isinstance(v, int | float) else None


def eval_scores(frame: pd.DataFrame) -> tuple[float | None, int | None, float | None]:
    """(best eval/pass@1, its step, the latest eval/pass@1) from a metrics frame; Nones before any eval."""
    if "eval/pass@1" not in frame:
        return None, None, None
    evals = frame["eval/pass@1"].dropna()
    if evals.empty:
        return None, None, None
    return float(evals.max()), int(evals.idxmax()), float(evals.iloc[-1])


def run_duration(summary: dict, frame: pd.DataFrame) -> float | None:
    """Wall seconds of a finished run (summary.json), else the sum of the per-step stage seconds so far."""
    total = (summary.get("seconds") or {}).get("total")
    if total is not None:
        return float(total)
    cols = [c for c in frame.columns if c.startswith("time/") and c.endswith("_s") and c != CHECKPOINT_TOTAL]
    return float(frame[cols].sum().sum()) if cols else None


# ---------------------------------------------------------------- metrics, stage times, samples


def metrics_frame(rows: list[dict]) -> pd.DataFrame:
    """metrics.jsonl rows as a float frame indexed by step; rows of one step are merged, the last value of each
    column winning (a checkpoint's record is a second row of its step; a redone step overrides)."""
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        return pd.DataFrame(index=pd.Index([], name="step", dtype=int))
    frame = pd.DataFrame(rows).apply(pd.to_numeric, errors="coerce")
    return frame.groupby("step").last().sort_index()


def metric_names(frame: pd.DataFrame) -> list[str]:
    """Metric columns that hold at least one number, sorted."""
    return sorted(c for c in frame.columns if frame[c].notna().any())


def stage_times(frame: pd.DataFrame) -> pd.DataFrame:
    """Long frame (step, stage, seconds) of the `time/<stage>_s` columns, for a stacked bar per step. A checkpoint
    is two segments that add up to `time/checkpoint_s`: `checkpoint stall` (the loop waited) and `checkpoint
    background` (written while training went on; 0 for a synchronous save)."""
    frame = frame.copy()
    if CHECKPOINT_TOTAL in frame.columns and CHECKPOINT_STALL in frame.columns:
        frame[CHECKPOINT_TOTAL] = (frame[CHECKPOINT_TOTAL] - frame[CHECKPOINT_STALL]).clip(lower=0)
    cols = {c: CHECKPOINT_NAMES.get(c, c[len("time/") : -len("_s")]) for c in frame.columns
            if c.startswith("time/") and c.endswith("_s")}  # fmt: skip
    if not cols:
        return pd.DataFrame(columns=["step", "stage", "seconds"])
    long = frame[list(cols)].rename(columns=cols).reset_index().melt("step", var_name="stage", value_name="seconds")
    return long.dropna(subset=["seconds"]).reset_index(drop=True)


def verifier_names(frame: pd.DataFrame) -> list[str]:
    """Verifiers with a `reward/<name>/mean` column."""
    return sorted(
        c.split("/")[1] for c in frame.columns if c.startswith("reward/") and c.endswith("/mean") and c.count("/") == 2
    )


def samples_frame(rows: list[dict]) -> pd.DataFrame:
    """samples.jsonl rows with one `score/<verifier>` column per verifier (None = the verifier gave no score), then
    where the run records them (`LAG_COLUMNS`) whether the sample's group had zero reward std and its staleness in
    policy versions. A multi-turn run's rows also get the episode's figures (`EPISODE_COLUMNS`) and its `transcript`
    (the segments); a run whose samples carry their tokens, a `TOKENS` column saying which do (the records
    themselves stay out of the cached frame: `sample_tokens` reads the one the token view shows)."""
    base = ["step", "prompt", "answer", "completion", "reward", "advantage"]
    if not rows:
        return pd.DataFrame(columns=base)
    multiturn = any(transcripts.is_multiturn(r) for r in rows)
    lag = [c for c, key in LAG_COLUMNS.items() if any(key in r for r in rows)]  # absent from older runs
    with_tokens = any(tokens.has_tokens(r.get("tokens")) for r in rows)
    flat = []
    for r in rows:
        scores = r.get("scores") or {}
        flat.append({**{k: r.get(k) for k in base}, **{f"score/{v}": s for v, s in scores.items()}})
        flat[-1].update({c: r.get(LAG_COLUMNS[c]) for c in lag})
        if multiturn:
            flat[-1].update(episode_columns(r))
        if with_tokens:
            flat[-1][TOKENS] = tokens.has_tokens(r.get("tokens"))
    frame = pd.DataFrame(flat)
    for col in ["reward", "advantage", *(c for c in frame.columns if c.startswith("score/"))]:
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    if "zero-std group" in lag:
        frame["zero-std group"] = frame["zero-std group"].astype("boolean")
    if "staleness" in lag:
        frame["staleness"] = frame["staleness"].astype("Int64")
    if multiturn:  # nullable dtypes: a count stays an integer and a flag a flag beside rows that lack them
        frame[list(EPISODE_COLUMNS[:3])] = frame[list(EPISODE_COLUMNS[:3])].astype("Int64")
        frame["truncated"] = frame["truncated"].astype("boolean")
    return frame


def sample_tokens(path: Path, index: int) -> dict | None:
    """The token record of the sample at `index` of `samples_frame(read_jsonl(path))` (None: not recorded)."""
    rows = read_jsonl(path)
    record = rows[index].get("tokens") if 0 <= index < len(rows) else None
    return record if tokens.has_tokens(record) else None


def episode_columns(sample: dict) -> dict:
    """The multi-turn columns of one sample (None figures for a row without a transcript)."""
    if not transcripts.is_multiturn(sample):
        return {**dict.fromkeys(EPISODE_COLUMNS), "transcript": None}
    f = transcripts.figures(sample)
    figures = (f.turns, f.tool_calls, f.tool_errors, f.truncated)
    return {**dict(zip(EPISODE_COLUMNS, figures, strict=True)), "transcript": sample["transcript"]}


def filter_samples(
    samples: pd.DataFrame, steps: tuple[int, int], reward: tuple[float, float], text: str = ""
) -> pd.DataFrame:
    """Samples with step and reward inside the closed ranges (a missing reward never matches) and `text` in
    the prompt or completion (case-insensitive)."""
    keep = samples["step"].between(*steps) & samples["reward"].between(*reward)
    if text:
        needle = text.lower()
        hay = samples["prompt"].astype(str).str.lower() + "\n" + samples["completion"].astype(str).str.lower()
        keep &= hay.str.contains(needle, regex=False)
    return samples[keep]


# ---------------------------------------------------------------- checkpoints, plan, config, ensemble


def checkpoints(run_dir: Path) -> list[dict]:
    """Finished checkpoints (step, eval pass@1 at save time, a later `forgeweave eval` result, latest flag)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    latest = _text(root / "latest")
    out = []
    for d in sorted(root.glob("step-*")):  # in-progress ones are hidden ".step-*" temporaries
        meta = read_json(d / "checkpoint.json")
        if meta is None:
            continue
        later = read_json(d / "eval.json") or {}
        out.append(
            {
                "checkpoint": d.name,
                "step": int(meta.get("step", 0)),
                "eval pass@1": meta.get("eval_pass@1"),
                "re-eval pass@1": later.get("pass@1"),
                "latest": d.name == latest,
                "path": str(d.resolve()),
            }
        )
    return out


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def plan_tables(plan: dict | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(pools, assignments) frames of a Weaver plan.json; empty frames when the run has no plan."""
    if not plan:
        return pd.DataFrame(), pd.DataFrame()
    pools = pd.DataFrame(plan.get("pools") or [])
    if "devices" in pools:
        pools["devices"] = pools["devices"].map(lambda d: ",".join(map(str, d)) or "-")
    rows = [
        {
            "stage": a.get("stage"),
            "kind": a.get("kind"),
            "placement": "; ".join(_placement(p) for p in a.get("placements") or []),
            "colocated with": ", ".join(a.get("colocated_with") or []),
            "reason": a.get("reason", ""),
        }
        for a in plan.get("assignments") or []
    ]
    return pools, pd.DataFrame(rows)


def workers_table(workers: dict | None) -> pd.DataFrame:
    """One row per worker process of a run's workers.json (stage -> [host, pid, node, devices, threads, ...])."""
    rows = [
        {
            "stage": stage,
            "#": w.get("rank", i),
            "host": w.get("host"),
            "pid": w.get("pid"),
            "ray node": (w.get("node_id") or "-")[:12],
            "pool": w.get("pool") or "-",
            "devices": w.get("cuda_visible_devices") or "-",
            "threads": w.get("threads"),
            "python": w.get("python", ""),
        }
        for stage, ws in (workers or {}).items()
        for i, w in enumerate(ws)
    ]
    return pd.DataFrame(rows)


def _placement(p: dict) -> str:
    devices = ",".join(map(str, p.get("devices") or []))
    where = f"{p.get('pool')}@{p.get('host')}" + (f" devices {devices}" if devices else "")
    work_pool = f" (work pool {p['work_pool']})" if p.get("work_pool") else ""
    return f"{where} × {p.get('processes', 1)} process(es){work_pool}"


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (the dotted keys `--set` takes)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(configs: dict[str, dict]) -> pd.DataFrame:
    """The dotted config keys whose values differ between runs: one row per key, one column per run.

    `configs` maps run name -> nested config; a key absent from a run shows as "(absent)"."""
    flat = {name: flatten(cfg) for name, cfg in configs.items()}
    keys = sorted(set().union(*flat.values())) if flat else []
    rows = []
    for key in keys:
        shown = {name: show_value(f.get(key, _ABSENT)) for name, f in flat.items()}
        if len(set(shown.values())) > 1:
            rows.append({"key": key, **shown})
    return pd.DataFrame(rows, columns=["key", *configs])


_ABSENT = object()


def show_value(v) -> str:
    """A config value as one string (JSON for non-strings), so mixed types fit one table column."""
    if v is _ABSENT:
        return "(absent)"
    return v if isinstance(v, str) else json.dumps(v)


def latest_ensemble_report(run_dir: Path) -> tuple[int, pd.DataFrame] | None:
    """(step, per-verifier weight / estimated AUROC) of the newest ensemble/step-N.json; None without one."""
    files = sorted((run_dir / "ensemble").glob("step-*.json"))
    for path in reversed(files):
        report = read_json(path)
        if report and report.get("names"):
            table = pd.DataFrame(
                {"verifier": report["names"], "weight": report.get("weights"), "est. AUROC": report.get("est_auroc")}
            )
            return int(path.stem.split("-")[1]), table
    return None


GUARD_COLUMNS = ["step", "action", "best_step", "probe_before", "probe_after", "reward_before", "reward_after",
                 "rollbacks"]  # fmt: skip


def guard_events(run_dir: Path) -> pd.DataFrame:
    """The collapse guard's firings (guard.jsonl: one row each, in order); empty without any."""
    rows = [r for r in read_jsonl(run_dir / "guard.jsonl") if "step" in r]
    return pd.DataFrame([{c: r.get(c) for c in GUARD_COLUMNS} for r in rows], columns=GUARD_COLUMNS)


def guard_summary(events: pd.DataFrame) -> str:
    """One line about the guard's firings, for a warning above their table ('' when it never fired).

    >>> guard_summary(pd.DataFrame([{"step": 25, "action": "rollback", "best_step": 5, "probe_before": 1.0,
    ...                              "probe_after": 0.0, "reward_before": 0.03, "reward_after": 0.41}]))
    'collapse guard fired 1 time: probe pass@1 fell while reward/mean rose; last at step 25: rollback to step 5'
    """
    if events.empty:
        return ""
    last, n = events.iloc[-1], len(events)
    what = {"rollback": f"rollback to step {last['best_step']}", "stop": f"stopped with the weights of step "
            f"{last['best_step']}"}.get(last["action"], str(last["action"]))  # fmt: skip
    return (
        f"collapse guard fired {n} time{'s' if n > 1 else ''}: probe pass@1 fell while reward/mean rose; "
        f"last at step {last['step']}: {what}"
    )


def fmt_seconds(s: float | None) -> str:
    """12.34 -> '12.3 s', 754 -> '12m 34s', 10865 -> '3h 01m', None -> '-' (short: it fits an st.metric)."""
    if s is None or not math.isfinite(s):
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    minutes, sec = divmod(round(s), 60)
    return f"{minutes}m {sec:02d}s" if minutes < 60 else f"{minutes // 60}h {minutes % 60:02d}m"


def runs_table(overviews: list[RunOverview], mlflow_ids: dict[str, str], now: float) -> pd.DataFrame:
    """The Runs page table: one row per run, newest update first. `mlflow_ids` maps run name -> MLflow run id."""
    rows = [
        {
            "run": o.name,
            "status": o.state,
            "preset": o.preset or "-",
            "model": o.model,
            "steps": f"{o.step}/{o.total_steps}" if o.total_steps else str(o.step),
            "progress": min(o.step / o.total_steps, 1.0) if o.total_steps else None,
            "best eval pass@1": o.best_pass1,
            "at step": o.best_step,
            "duration": fmt_seconds(o.duration_s),
            "updated": fmt_age(now - o.updated) if o.updated else "-",
            "MLflow run": mlflow_ids.get(o.name) or o.mlflow_run_id or "",
            "error": o.error,
        }
        for o in sorted(overviews, key=lambda o: o.updated or 0.0, reverse=True)
    ]
    return pd.DataFrame(rows)


def fmt_age(seconds: float) -> str:
    """How long ago, coarsely: '5 s ago', '3 min ago', '2 h ago', '4 d ago'."""
    s = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{int(s // size)} {unit} ago"
    return f"{int(s)} s ago"
