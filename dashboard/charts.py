"""Altair chart builders for the pages (altair ships with streamlit): curves, the reward band, stage bars.

Every builder takes a metrics frame indexed by step (see `dashboard.data.metrics_frame`) or a long frame, and
returns None when there is nothing to draw, so a page can say "no data yet" instead of showing an empty axis.
Metric names go through a long (step, metric, value) frame: Vega-Lite reads "." in a field name as nesting.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

HEIGHT = 180  # of the plotting area; title, axes and legend come on top (autosize fit-x, not Streamlit's "fit")
LEGEND = alt.Legend(orient="bottom", title=None, labelLimit=400)
Y_FORMAT = ",.4~g"  # 0.0008, 12,000 and a plain 0 (Vega's default turns a constant 0 into "0.000000")


def _sized(chart, title: str, height: int = HEIGHT):
    """Title and height; Streamlit's default autosize "fit" would squeeze the plot to leave room for the legend."""
    return chart.properties(title=title, height=height, autosize=alt.AutoSizeParams(type="fit-x", contains="padding"))


def long_frame(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """(step, metric, value) rows of the given columns that exist, without missing values."""
    cols = [c for c in columns if c in frame.columns]
    if not cols:
        return pd.DataFrame(columns=["step", "metric", "value"])
    out = frame[cols].reset_index().melt("step", var_name="metric", value_name="value")
    return out.dropna(subset=["value"]).reset_index(drop=True)


def lines(frame: pd.DataFrame, columns: list[str], title: str, points: bool = False) -> alt.Chart | None:
    """One line per metric against the step; `points` marks each value (for sparse metrics like evals)."""
    data = long_frame(frame, columns)
    return None if data.empty else _sized(_line_layer(data, points), title)


def _line_layer(data: pd.DataFrame, points: bool) -> alt.Chart:
    return (
        alt.Chart(data)
        .mark_line(point=points)
        .encode(
            x=alt.X("step:Q", title="step"),
            y=alt.Y("value:Q", title=None, axis=alt.Axis(format=Y_FORMAT)),
            color=alt.Color("metric:N", legend=LEGEND),
            tooltip=["step:Q", "metric:N", alt.Tooltip("value:Q", format=".4g")],
        )
    )


def reward_chart(frame: pd.DataFrame, verifiers: list[str]) -> alt.LayerChart | None:
    """Batch reward: the mean with a ±1 std band, plus each verifier's mean score."""
    if "reward/mean" not in frame.columns or frame["reward/mean"].dropna().empty:
        return None
    band = frame[["reward/mean"]].rename(columns={"reward/mean": "mean"}).reset_index().dropna()
    std = frame["reward/std"].reindex(band["step"]).fillna(0.0).to_numpy() if "reward/std" in frame else 0.0
    band["low"], band["high"] = band["mean"] - std, band["mean"] + std
    area = alt.Chart(band).mark_area(opacity=0.2).encode(x="step:Q", y=alt.Y("low:Q", title=None), y2="high:Q")
    curves = _line_layer(long_frame(frame, ["reward/mean", *(f"reward/{v}/mean" for v in verifiers)]), False)
    return _sized(alt.layer(area, curves), "reward (mean ± std, per verifier)")


def stage_bars(times: pd.DataFrame) -> alt.Chart | None:
    """Seconds per stage stacked into one bar per step (input: `dashboard.data.stage_times`)."""
    if times.empty:
        return None
    chart = (
        alt.Chart(times)
        .mark_bar()
        .encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap="greedy", labelAngle=0)),
            y=alt.Y("sum(seconds):Q", title="seconds", stack="zero"),
            color=alt.Color("stage:N", legend=LEGEND),
            tooltip=["step:O", "stage:N", alt.Tooltip("seconds:Q", format=".3f")],
        )
    )
    return _sized(chart, "seconds per stage")


def overlay(frames: dict[str, pd.DataFrame], metric: str, height: int = HEIGHT) -> alt.Chart | None:
    """One metric of several runs on one axis, coloured by run."""
    parts = []
    for name, frame in frames.items():
        if metric in frame.columns:
            part = frame[[metric]].dropna().reset_index().rename(columns={metric: "value"})
            parts.append(part.assign(run=name))
    data = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if data.empty:
        return None
    sparse = len(data) <= 3 * len(parts) or metric.startswith("eval/")
    chart = (
        alt.Chart(data)
        .mark_line(point=sparse)
        .encode(
            x=alt.X("step:Q"),
            y=alt.Y("value:Q", title=metric, axis=alt.Axis(format=Y_FORMAT)),
            color=alt.Color("run:N", legend=alt.Legend(orient="bottom", labelLimit=400)),
            tooltip=["run:N", "step:Q", alt.Tooltip("value:Q", format=".4g")],
        )
    )
    return _sized(chart, metric, height)


PROFILE = "distill/reverse_kl_q"  # forge/rewards/teacher.py position_profile: quarters of the sampled tokens


def position_profile(frame: pd.DataFrame) -> alt.Chart | None:
    """On-policy distillation: the reverse KL to the teacher by quarter of each completion's sampled tokens, at the
    first and the last step that recorded it (grouped bars): where in the completion the student disagrees."""
    cols = sorted(c for c in frame.columns if c.startswith(PROFILE))
    rows = frame[cols].dropna(how="all") if cols else frame.iloc[0:0]
    if rows.empty:
        return None
    picked = rows.loc[sorted({rows.index[0], rows.index[-1]})]
    data = picked.reset_index().melt("step", var_name="quarter", value_name="value").dropna(subset=["value"])
    data["quarter"] = data["quarter"].str.removeprefix(PROFILE).map(lambda q: f"quarter {q}")
    data["step"] = data["step"].map(lambda s: f"step {s}")
    chart = (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("quarter:N", title="position in the completion (quarters of its sampled tokens)"),
            xOffset="step:N",
            y=alt.Y("value:Q", title=None, axis=alt.Axis(format=Y_FORMAT)),
            color=alt.Color("step:N", legend=LEGEND),
            tooltip=["step:N", "quarter:N", alt.Tooltip("value:Q", format=".4g")],
        )
    )
    return _sized(chart, "reverse KL to the teacher by position (first and last step)")
