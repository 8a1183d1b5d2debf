"""Pieces the pages share: the run picker (kept across pages and in the URL), the empty state, live refresh."""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from dashboard import loaders

REFRESH_S = 5  # seconds between re-reads of the run directories while live refresh is on
SELECTED = "selected_run"  # session-state key of the run picked on any page


def empty_state() -> None:
    d = loaders.runs_dir()
    st.info(f"No runs in `{d}` yet. Start one, and it appears here while it trains:")
    st.code(f"forgeweave run --preset tiny --runs-dir {d}", language="bash")


def pick_run(names: list[str]) -> str:
    """A run selectbox; starts on ?run=NAME, else the run picked on another page, else the newest run."""
    wanted = st.query_params.get("run") or st.session_state.get(SELECTED)
    if wanted not in names:
        wanted = max(names, key=lambda n: loaders.overview(n).updated or 0.0)
    choice = st.selectbox("Run", names, index=names.index(wanted))
    st.session_state[SELECTED] = choice
    st.query_params["run"] = choice
    return choice


def live(render: Callable[[], None], default: bool, key: str) -> None:
    """Call `render` inside a fragment that re-runs every REFRESH_S seconds while the toggle is on."""
    on = st.toggle(f"Live refresh (every {REFRESH_S} s)", value=default, key=key)
    st.fragment(render, run_every=REFRESH_S if on else None)()


def fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
