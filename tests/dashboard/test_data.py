"""dashboard.data and dashboard.mlflow_store: the readers behind the pages, on a real tiny run and on
hand-made rows whose expected numbers are worked out in the comments."""

import json
import math

import pytest

from dashboard import data, mlflow_store
from tests.dashboard.conftest import RUN, make_half_written, read_metrics


def test_read_jsonl_skips_torn_and_garbled_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "a": 1}\nnot json\n[1, 2]\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    assert data.read_jsonl(path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]
    assert data.read_jsonl(tmp_path / "missing.jsonl") == []
    (tmp_path / "s.json").write_text('{"state": "runn')  # never happens with atomic writes, but must not raise
    assert data.read_json(tmp_path / "s.json") is None


def test_overview_of_a_finished_run_matches_its_files(tiny_run):
    o = data.run_overview(tiny_run)
    summary = json.loads((tiny_run / "summary.json").read_text())
    evals = {r["step"]: r["eval/pass@1"] for r in read_metrics(tiny_run) if "eval/pass@1" in r}
    assert sorted(evals) == [0, 4, 8, 12]
    best = max(evals.values())
    assert (o.name, o.state, o.step, o.total_steps, o.preset, o.model) == (
        RUN,
        "finished",
        12,
        12,
        "tiny",
        "tiny-random",
    )
    assert o.best_pass1 == pytest.approx(best)
    assert evals[o.best_step] == best and o.best_step == min(s for s, v in evals.items() if v == best)
    assert o.last_pass1 == pytest.approx(evals[12]) == pytest.approx(summary["eval"]["final"]["pass@1"])
    assert o.duration_s == pytest.approx(summary["seconds"]["total"])
    assert o.error == "" and o.path == str(tiny_run.resolve())


def test_overview_of_a_half_written_run(runs_copy):
    run = runs_copy / RUN
    make_half_written(run, step=6)
    o = data.run_overview(run)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(7))  # the torn 7th row is skipped
    assert (o.state, o.step, o.total_steps) == ("running", 6, 12)
    assert o.best_step in (0, 4) and o.last_pass1 == pytest.approx(rows[4]["eval/pass@1"])
    # no summary yet: the duration is the stage seconds logged so far (a checkpoint's stall, not its background)
    expected = sum(v for r in rows for k, v in r.items() if k.startswith("time/") and k != "time/checkpoint_s")
    assert o.duration_s == pytest.approx(expected)
    assert [c["step"] for c in data.checkpoints(run)] == [4]


def test_overview_of_a_failed_run_and_of_a_bare_directory(tmp_path):
    run = tmp_path / "broken"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 3, "error": "ValueError: bad"}))
    o = data.run_overview(run)
    assert (o.state, o.step, o.error, o.total_steps, o.best_pass1, o.duration_s) == (
        "failed",
        3,
        "ValueError: bad",
        None,
        None,
        None,
    )
    (tmp_path / "not-a-run").mkdir()  # e.g. MLflow's artifact folder beside the runs
    (tmp_path / "mlflow.db").write_text("")
    assert [p.name for p in data.find_runs(tmp_path)] == ["broken"]
    assert data.find_runs(tmp_path / "absent") == []


def test_metrics_frame_merges_the_rows_of_a_repeated_step():
    rows = [{"step": 0, "eval/pass@1": 0.1}, {"step": 1, "reward/mean": 0.2}, {"step": 1, "reward/mean": 0.3}, {"x": 1},
            {"step": 0, "time/checkpoint_s": 2.0}]  # fmt: skip
    frame = data.metrics_frame(rows)
    assert list(frame.index) == [0, 1]
    assert frame.loc[1, "reward/mean"] == 0.3 and math.isnan(frame.loc[0, "reward/mean"])
    assert frame.loc[0, "eval/pass@1"] == 0.1 and frame.loc[0, "time/checkpoint_s"] == 2.0
    assert data.metric_names(frame) == ["eval/pass@1", "reward/mean", "time/checkpoint_s"]
    assert data.metrics_frame([]).empty


def test_stage_times_are_a_long_frame_of_the_time_columns(tiny_run):
    frame = data.metrics_frame(read_metrics(tiny_run))
    times = data.stage_times(frame)
    assert set(times["stage"]) == {"rollout", "reward", "update", "evaluate", "checkpoint stall",
                                   "checkpoint background"}  # fmt: skip
    saves = times[times.stage.str.startswith("checkpoint")].groupby("step")["seconds"].sum()
    assert list(saves.index) == [4, 8, 12]  # checkpoint.every=4: the two segments add up to time/checkpoint_s
    assert saves.to_numpy() == pytest.approx(frame.loc[[4, 8, 12], "time/checkpoint_s"].to_numpy())
    # evaluate only on eval steps (4, 8, 12: the step-0 eval row has no time/ columns)
    assert sorted(times[times.stage == "evaluate"]["step"]) == [4, 8, 12]
    for stage in ("rollout", "update"):
        assert times[times.stage == stage]["seconds"].sum() == pytest.approx(frame[f"time/{stage}_s"].sum())


def test_a_checkpoint_is_a_stall_and_a_background_segment():
    # async save: the loop waited 0.1 s, the write finished 0.4 s later; sync save: all 0.7 s were a stall
    frame = data.metrics_frame([{"step": 1, "time/checkpoint_s": 0.5, "time/checkpoint_stall_s": 0.1},
                                {"step": 2, "time/checkpoint_s": 0.7, "time/checkpoint_stall_s": 0.7}])  # fmt: skip
    got = {(r.step, r.stage): r.seconds for r in data.stage_times(frame).itertuples()}
    assert got == pytest.approx({(1, "checkpoint background"): 0.4, (2, "checkpoint background"): 0.0,
                                 (1, "checkpoint stall"): 0.1, (2, "checkpoint stall"): 0.7})  # fmt: skip


def test_samples_filter_by_step_reward_and_text():
    rows = [
        {"step": 1, "prompt": "1+1=", "completion": "2", "scores": {"math": 1.0}, "reward": 1.0, "advantage": 0.5},
        {"step": 1, "prompt": "1+1=", "completion": "7", "scores": {"math": 0.0}, "reward": 0.0, "advantage": -0.5},
        {"step": 2, "prompt": "2+3=", "completion": "5", "scores": {"math": None}, "reward": None, "advantage": None},
        {"step": 3, "prompt": "4+4=", "completion": "8", "scores": {"math": 1.0}, "reward": 1.0, "advantage": 0.1},
    ]
    frame = data.samples_frame(rows)
    assert list(frame.columns) == ["step", "prompt", "answer", "completion", "reward", "advantage", "score/math"]
    assert math.isnan(frame.loc[2, "score/math"])
    # steps 1..3 with reward in [0.5, 1]: rows 0 and 3 (row 2 has no reward, so no reward range matches it)
    assert list(data.filter_samples(frame, (1, 3), (0.5, 1.0)).index) == [0, 3]
    assert list(data.filter_samples(frame, (1, 2), (-1.0, 1.0)).index) == [0, 1]
    assert list(data.filter_samples(frame, (0, 9), (0.0, 1.0), text="4+4").index) == [3]
    assert data.samples_frame([]).empty


def test_checkpoints_list_finished_ones_with_their_scores(tiny_run, tmp_path):
    ckpts = data.checkpoints(tiny_run)
    on_disk = sorted(p.name for p in (tiny_run / "checkpoints").glob("step-*"))
    assert [c["checkpoint"] for c in ckpts] == on_disk and on_disk[-1] == "step-000012"
    evals = {r["step"]: r["eval/pass@1"] for r in read_metrics(tiny_run) if "eval/pass@1" in r}
    for c in ckpts:
        assert c["eval pass@1"] == pytest.approx(evals[c["step"]])
        assert c["latest"] == (c["checkpoint"] == "step-000012")
        assert c["re-eval pass@1"] is None
    # a checkpoint being written (hidden temporary) is not listed; a later `forgeweave eval` result is
    (tiny_run / "checkpoints" / ".step-000016.tmp").mkdir(exist_ok=True)
    try:
        assert len(data.checkpoints(tiny_run)) == len(ckpts)
    finally:
        (tiny_run / "checkpoints" / ".step-000016.tmp").rmdir()


def test_workers_table_of_a_real_run(tiny_run):
    table = data.workers_table(json.loads((tiny_run / "workers.json").read_text()))
    assert set(table["stage"]) == {"rollout", "reward", "update"}
    assert table["pid"].nunique() == 1  # in-process: every worker is the run's own process
    assert set(table["ray node"]) == {"-"} and data.workers_table(None).empty


def test_plan_tables_of_a_real_plan(tiny_run):
    pools, assignments = data.plan_tables(json.loads((tiny_run / "plan.json").read_text()))
    assert list(assignments["stage"]) == ["prep", "rollout", "reward", "update", "evaluate"]
    assert list(pools["name"]) == ["cpu"]
    assert assignments.iloc[0]["placement"].startswith("cpu@") and "1 process" in assignments.iloc[0]["placement"]
    assert all(assignments["reason"])
    assert all(f.empty for f in data.plan_tables(None))


def test_config_diff_lists_only_differing_keys():
    a = {"steps": 10, "update": {"lr": 1e-3, "betas": [0.9, 0.99]}, "preset": "tiny"}
    b = {"steps": 10, "update": {"lr": 5e-4, "betas": [0.9, 0.99]}, "preset": "tiny", "extra": {"k": "v"}}
    diff = data.config_diff({"a": a, "b": b})
    assert diff.to_dict("records") == [
        {"key": "extra.k", "a": "(absent)", "b": "v"},
        {"key": "update.lr", "a": "0.001", "b": "0.0005"},
    ]
    assert data.config_diff({"a": a, "a2": dict(a)}).empty


def test_runs_table_and_formatting(tiny_run):
    o = data.run_overview(tiny_run)
    table = data.runs_table([o], {RUN: "abc123"}, now=o.updated + 125)
    row = table.iloc[0].to_dict()
    assert row["run"] == RUN and row["status"] == "finished" and row["steps"] == "12/12" and row["progress"] == 1.0
    assert row["updated"] == "2 min ago" and row["MLflow run"] == "abc123"
    assert data.fmt_seconds(12.34) == "12.3 s" and data.fmt_seconds(754) == "12m 34s"
    assert data.fmt_seconds(3 * 3600 + 65) == "3h 01m" and data.fmt_seconds(None) == "-"
    assert data.fmt_age(5) == "5 s ago" and data.fmt_age(2 * 86400 + 1) == "2 d ago"


def test_latest_ensemble_report(tmp_path):
    assert data.latest_ensemble_report(tmp_path) is None
    (tmp_path / "ensemble").mkdir()
    for step, w in ((2, 0.1), (10, 0.7)):  # step-10 sorts after step-2 only with zero padding, as the recipe writes
        report = {"names": ["math", "format"], "weights": [w, 0.2], "est_auroc": [0.9, 0.6]}
        (tmp_path / "ensemble" / f"step-{step:06d}.json").write_text(json.dumps(report))
    step, table = data.latest_ensemble_report(tmp_path)
    assert step == 10 and table.to_dict("records")[0] == {"verifier": "math", "weight": 0.7, "est. AUROC": 0.9}


# ---------------------------------------------------------------- MLflow


def test_mlflow_index_without_a_store_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_store.tracking_uri(tmp_path) == ""
    index = mlflow_store.read_index("")
    assert index.run_id("x", "/x") == "" and not index.error
    assert list(tmp_path.iterdir()) == []


def test_mlflow_index_reports_an_unreadable_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "mlflow.db").write_text("this is not sqlite")
    index = mlflow_store.read_index(mlflow_store.tracking_uri(tmp_path))
    assert index.error and index.by_name == {}


def test_mlflow_index_finds_runs_by_tag_then_name(mlflow_store_dir, monkeypatch):
    runs, ids = mlflow_store_dir
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    index = mlflow_store.read_index(mlflow_store.tracking_uri(runs))
    assert index.uri == f"sqlite:///{runs / 'mlflow.db'}" and not index.error
    assert index.run_id(RUN, str(runs / RUN)) == ids["tagged"]  # the tag wins over an older run of the same name
    assert index.run_id("other", "/elsewhere/other") == ids["untagged"]  # no tag: matched by name
    assert index.run_id("absent", "/absent") == ""
    assert index.run_url(ids["tagged"]) == ""  # a file store has no UI to link to
    served = mlflow_store.MlflowIndex(uri="http://127.0.0.1:5000", experiment_id="1")
    assert served.run_url("abc") == "http://127.0.0.1:5000/#/experiments/1/runs/abc"


def test_tracking_uri_prefers_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    (tmp_path / "mlflow.db").write_text("")
    assert mlflow_store.tracking_uri(tmp_path) == "http://127.0.0.1:5999"
