"""Cached loaders: `dashboard.data` readers behind `st.cache_data`, keyed on the files' mtimes and sizes.

Each public loader stats the files it depends on and passes (mtime_ns, size) stamps as an argument of the
cached function, so a file a live run has just appended to is read again on the next refresh while unchanged
runs cost one `stat` per file. The runs directory comes from $FORGEWEAVE_RUNS_DIR (set by
`forgeweave dashboard --runs-dir`), default ./runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import data, mlflow_store

# the server store has no file to stat: its index is reused for this many seconds
MLFLOW_SERVER_TTL_S = 15


def runs_dir() -> Path:
    return Path(os.environ.get("FORGEWEAVE_RUNS_DIR", "runs")).resolve()


def stamp(*paths: Path) -> tuple:
    """(mtime_ns, size) per path, None for a missing one: the cache key of whatever was read from them."""
    out = []
    for p in paths:
        try:
            s = p.stat()
            out.append((s.st_mtime_ns, s.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def run_names() -> list[str]:
    """Run directory names under the runs dir (not cached: one directory listing)."""
    return [p.name for p in data.find_runs(runs_dir())]


def run_path(name: str) -> Path:
    return runs_dir() / name


def overview(name: str) -> data.RunOverview:
    d = run_path(name)
    files = [d / f for f in ("status.json", "config.yaml", "summary.json", "metrics.jsonl")]
    return _overview(str(d), stamp(*files))


@st.cache_data(show_spinner=False, max_entries=512)
def _overview(path: str, key: tuple) -> data.RunOverview:
    return data.run_overview(Path(path))


def metrics(name: str) -> pd.DataFrame:
    path = run_path(name) / "metrics.jsonl"
    return _metrics(str(path), stamp(path))


@st.cache_data(show_spinner=False, max_entries=128)
def _metrics(path: str, key: tuple) -> pd.DataFrame:
    return data.metrics_frame(data.read_jsonl(Path(path)))


def samples(name: str) -> pd.DataFrame:
    path = run_path(name) / "samples.jsonl"
    return _samples(str(path), stamp(path))


@st.cache_data(show_spinner=False, max_entries=32)
def _samples(path: str, key: tuple) -> pd.DataFrame:
    return data.samples_frame(data.read_jsonl(Path(path)))


def sample_tokens(name: str, index: int) -> dict | None:
    """The token record of sample `index` (the samples frame's index), read when the token view shows it."""
    path = run_path(name) / "samples.jsonl"
    return _sample_tokens(str(path), stamp(path), index)


@st.cache_data(show_spinner=False, max_entries=64)
def _sample_tokens(path: str, key: tuple, index: int) -> dict | None:
    return data.sample_tokens(Path(path), index)


def config(name: str) -> dict:
    path = run_path(name) / "config.yaml"
    return _config(str(path), stamp(path))


@st.cache_data(show_spinner=False, max_entries=128)
def _config(path: str, key: tuple) -> dict:
    return data.read_yaml(Path(path)) or {}


def plan(name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    path = run_path(name) / "plan.json"
    return _plan(str(path), stamp(path))


@st.cache_data(show_spinner=False, max_entries=64)
def _plan(path: str, key: tuple) -> tuple[pd.DataFrame, pd.DataFrame]:
    return data.plan_tables(data.read_json(Path(path)))


def workers(name: str) -> pd.DataFrame:
    path = run_path(name) / "workers.json"
    return _workers(str(path), stamp(path))


@st.cache_data(show_spinner=False, max_entries=64)
def _workers(path: str, key: tuple) -> pd.DataFrame:
    return data.workers_table(data.read_json(Path(path)))


def checkpoints(name: str) -> list[dict]:
    root = run_path(name) / "checkpoints"
    dirs = sorted(root.glob("step-*")) if root.is_dir() else []
    files = [root / "latest", *(d / f for d in dirs for f in ("checkpoint.json", "eval.json"))]
    return _checkpoints(str(run_path(name)), stamp(root, *files))


@st.cache_data(show_spinner=False, max_entries=64)
def _checkpoints(path: str, key: tuple) -> list[dict]:
    return data.checkpoints(Path(path))


def ensemble_report(name: str) -> tuple[int, pd.DataFrame] | None:
    folder = run_path(name) / "ensemble"
    return _ensemble(str(run_path(name)), stamp(folder))  # a new report is a new file: the folder mtime moves


@st.cache_data(show_spinner=False, max_entries=64)
def _ensemble(path: str, key: tuple) -> tuple[int, pd.DataFrame] | None:
    return data.latest_ensemble_report(Path(path))


def guard_events(name: str) -> pd.DataFrame:
    path = run_path(name) / "guard.jsonl"
    return _guard_events(str(run_path(name)), stamp(path))


@st.cache_data(show_spinner=False, max_entries=64)
def _guard_events(path: str, key: tuple) -> pd.DataFrame:
    return data.guard_events(Path(path))


def mlflow_index() -> mlflow_store.MlflowIndex:
    uri = mlflow_store.tracking_uri(runs_dir())
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        key = stamp(db, db.with_name(db.name + "-wal"))
    else:
        key = (int(time.time() // MLFLOW_SERVER_TTL_S),)
    return _mlflow_index(uri, key)


@st.cache_data(show_spinner=False, max_entries=8)
def _mlflow_index(uri: str, key: tuple) -> mlflow_store.MlflowIndex:
    return mlflow_store.read_index(uri)
