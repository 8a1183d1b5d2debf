"""The run detail page of a run with a probe set: probe pass@1 beside eval pass@1 and the reward, and the collapse
guard's firings from guard.jsonl (the tiny run's copy, given the probe rows and firings a guarded run writes)."""

import json

import pandas as pd

from dashboard import data
from dashboard.views.run_detail import PROBE_TITLE
from tests.dashboard.conftest import RUN, charts, open_page, texts

PROBES = {0: 0.0, 4: 1.0, 8: 0.0, 12: 1.0}
FIRED = {"step": 8, "action": "rollback", "best_step": 4, "probe_before": 1.0, "probe_after": 0.0,
         "reward_before": 0.25, "reward_after": 0.6, "rollbacks": 1, "max_rollbacks": 2}  # fmt: skip


def add_guard_files(run) -> None:
    with (run / "metrics.jsonl").open("a") as f:  # a second row of each probe step, as the recipe logs them
        for step, p in PROBES.items():
            f.write(json.dumps({"step": step, "probe/pass@1": p, "guard/fired": float(step == 8)}) + "\n")
    (run / "guard.jsonl").write_text(json.dumps(FIRED) + "\n" + '{"step": 12, "act')  # a torn line is skipped


def test_run_detail_shows_probe_curve_and_guard_events(runs_copy, monkeypatch):
    add_guard_files(runs_copy / RUN)
    at = open_page(runs_copy, monkeypatch, "run_detail")
    probe = charts(at)[PROBE_TITLE][0]
    by_metric = {m: dict(zip(g["step"], g["value"], strict=True)) for m, g in probe.groupby("metric")}
    assert by_metric["probe/pass@1"] == PROBES
    assert set(by_metric["eval/pass@1"]) == {0, 4, 8, 12} and set(by_metric["reward/mean"]) == set(range(1, 13))
    assert (
        "collapse guard fired 1 time: probe pass@1 fell while reward/mean rose; last at step 8: rollback to step 4"
        in (texts(at))
    )
    table = next(d.value for d in at.dataframe if "best_step" in d.value.columns)
    assert table.to_dict("records") == [{c: FIRED[c] for c in data.GUARD_COLUMNS}]


def test_no_guard_section_without_firings(tiny_run, monkeypatch):
    at = open_page(tiny_run.parent, monkeypatch, "run_detail")
    assert PROBE_TITLE not in charts(at) and "collapse guard" not in texts(at)
    assert data.guard_events(tiny_run).empty and data.guard_summary(pd.DataFrame()) == ""
