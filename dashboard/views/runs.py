"""Runs page: every run under the runs directory with its status, progress, best eval and duration."""

import time

import streamlit as st

from dashboard import charts, data, loaders
from dashboard.widgets import empty_state, live

RECENT = 8  # runs drawn in the curves under the table
STATE_COLORS = {"running": "#1a7f37", "finished": "#0969da", "failed": "#cf222e"}
COLUMNS = {
    "progress": st.column_config.ProgressColumn("progress", min_value=0.0, max_value=1.0, format="percent"),
    "best eval pass@1": st.column_config.NumberColumn(format="%.3f"),
    "at step": st.column_config.NumberColumn(format="%d"),
}


def recent_curves(names: list[str]) -> None:
    """Reward and eval pass@1 of the most recent runs, side by side."""
    frames = {n: loaders.metrics(n) for n in names}
    for col, metric in zip(st.columns(2), ("reward/mean", "eval/pass@1"), strict=True):
        chart = charts.overlay(frames, metric)
        with col:
            if chart is None:
                st.caption(f"{metric}: no data yet")
            else:
                st.altair_chart(chart, width="stretch")


def runs_table() -> None:
    names = loaders.run_names()  # listed again on each refresh: new runs appear
    if not names:
        empty_state()
        return
    st.caption("Select a row to open the run.")
    overviews = [loaders.overview(n) for n in names]
    index = loaders.mlflow_index()
    counts = {s: sum(o.state == s for o in overviews) for s in ("running", "finished", "failed")}
    st.caption(
        f"{len(names)} run{'s' if len(names) != 1 else ''} — " + ", ".join(f"{n} {s}" for s, n in counts.items())
    )
    table = data.runs_table(overviews, {o.name: index.run_id(o.name, o.path) for o in overviews}, time.time())
    styled = table.style.map(lambda s: f"color: {STATE_COLORS.get(s, 'inherit')}; font-weight: 600", subset=["status"])
    picked = st.dataframe(
        styled, hide_index=True, column_config=COLUMNS, on_select="rerun", selection_mode="single-row", key="runs"
    )
    recent_curves([o.name for o in sorted(overviews, key=lambda o: o.updated or 0.0, reverse=True)[:RECENT]])
    if index.error:
        st.warning(f"MLflow store {index.uri} could not be read: {index.error}")
    if picked.selection.rows:
        name = table.iloc[picked.selection.rows[0]]["run"]
        st.switch_page("views/run_detail.py", query_params={"run": name})


def render() -> None:
    st.title("Runs")
    live(runs_table, default=True, key="live_runs")


render()
