"""Compare page: several runs' curves of one metric on one axis, their key numbers, and where their configs differ."""

import time

import streamlit as st

from dashboard import charts, data, loaders
from dashboard.widgets import empty_state

DEFAULT_METRIC = "reward/mean"


def pick_runs(names: list[str]) -> list[str]:
    newest = sorted(names, key=lambda n: loaders.overview(n).updated or 0.0, reverse=True)
    return st.multiselect("Runs", names, default=sorted(newest[:2]))


def overlay(picked: list[str]) -> None:
    frames = {n: loaders.metrics(n) for n in picked}
    metrics = sorted(set().union(*(data.metric_names(f) for f in frames.values())))
    if not metrics:
        st.info("the selected runs have no metrics yet")
        return
    default = metrics.index(DEFAULT_METRIC) if DEFAULT_METRIC in metrics else 0
    metric = st.selectbox("Metric", metrics, index=default)
    st.altair_chart(charts.overlay(frames, metric, height=2 * charts.HEIGHT), width="stretch")


def summary(picked: list[str]) -> None:
    overviews = [loaders.overview(n) for n in picked]
    table = data.runs_table(overviews, {}, time.time())
    keep = ["run", "status", "preset", "model", "steps", "best eval pass@1", "at step", "duration"]
    st.dataframe(
        table[keep], hide_index=True, column_config={"best eval pass@1": st.column_config.NumberColumn(format="%.3f")}
    )


def config_diff(picked: list[str]) -> None:
    st.subheader("Config differences")
    diff = data.config_diff({n: loaders.config(n) for n in picked})
    if len(picked) < 2:
        st.caption("pick two runs or more to see where their configs differ")
    elif diff.empty:
        st.success("the configs are identical")
    else:
        st.caption("1 key differs" if len(diff) == 1 else f"{len(diff)} keys differ")
        st.dataframe(diff, hide_index=True)


def render() -> None:
    st.title("Compare runs")
    names = loaders.run_names()
    if not names:
        empty_state()
        return
    picked = pick_runs(names)
    if not picked:
        st.info("pick one run or more")
        return
    overlay(picked)
    summary(picked)
    config_diff(picked)


render()
