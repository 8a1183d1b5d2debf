"""Every dashboard page through Streamlit's AppTest: on a real tiny run, on an empty runs dir, and on a run that
is half-written. The numbers a page shows are checked against the run's own files."""

import json
import time

import pytest

from tests.dashboard.conftest import RUN, charts, make_half_written, make_variant, open_page, read_metrics, texts

PAGES = [None, "run_detail", "compare", "checkpoints"]


def _metric(at, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_runs_page_lists_the_run_with_its_numbers(tiny_run, monkeypatch):
    at = open_page(tiny_run.parent, monkeypatch)
    table = at.dataframe[0].value
    row = table[table["run"] == RUN].iloc[0]
    summary = json.loads((tiny_run / "summary.json").read_text())
    best = max(r["eval/pass@1"] for r in read_metrics(tiny_run) if "eval/pass@1" in r)
    assert (row["status"], row["preset"], row["model"], row["steps"]) == ("finished", "tiny", "tiny-random", "12/12")
    assert row["best eval pass@1"] == pytest.approx(best)
    assert row["duration"] == f"{summary['seconds']['total']:.1f} s"
    assert "1 run — 0 running, 1 finished, 0 failed" in texts(at)
    # the curves under the table: reward/mean of the run, point for point
    reward = charts(at)["reward/mean"][0]
    expected = {r["step"]: r["reward/mean"] for r in read_metrics(tiny_run) if "reward/mean" in r}
    assert dict(zip(reward["step"], reward["value"], strict=True)) == pytest.approx(expected)
    assert set(charts(at)["eval/pass@1"][0]["step"]) == {0, 4, 8, 12}


def test_run_detail_shows_numbers_curves_samples_plan_and_config(tiny_run, monkeypatch):
    at = open_page(tiny_run.parent, monkeypatch, "run_detail")
    rows = read_metrics(tiny_run)
    assert at.selectbox[0].value == RUN
    assert _metric(at, "status") == "finished" and _metric(at, "steps") == "12/12"
    assert _metric(at, "best eval pass@1") == f"{max(r['eval/pass@1'] for r in rows if 'eval/pass@1' in r):.3f}"
    assert _metric(at, "last reward/mean") == f"{rows[-1]['reward/mean']:.3f}"
    shown = charts(at)
    for title in ("reward (mean ± std, per verifier)", "eval pass@k (held-out)", "KL to the reference", "entropy",
                  "learning rate", "grad norm", "clip fraction", "completion length (tokens)", "tokens / s",
                  "policy staleness (versions)", "trainer vs sampler log-prob gap", "idle share of the step",
                  "seconds per stage"):  # fmt: skip
        assert title in shown, title
    idle = shown["idle share of the step"][0]  # the async/overlap figures of every step, as logged
    trainer_idle = idle[idle["metric"] == "perf/trainer_idle_frac"] if "metric" in idle else idle
    assert len(trainer_idle) == 12 and ((trainer_idle["value"] >= 0) & (trainer_idle["value"] <= 1)).all()
    band = shown["reward (mean ± std, per verifier)"][0]  # the ±std band: mean - std .. mean + std per step
    assert list(band["step"]) == list(range(1, 13))
    assert band["high"].to_numpy() - band["low"].to_numpy() == pytest.approx([2 * r["reward/std"] for r in rows[1:]])
    bars = shown["seconds per stage"][0]
    assert bars.groupby("stage")["seconds"].sum()["update"] == pytest.approx(sum(r["time/update_s"] for r in rows[1:]))
    # samples: all of samples.jsonl, then filtered to steps 3..5 by the slider
    n = len((tiny_run / "samples.jsonl").read_text().splitlines())
    assert f"{n} of {n} samples" in texts(at)
    steps = next(s for s in at.slider if s.label == "steps")
    steps.set_value((3, 5)).run()
    per_step = n // 12
    assert f"{3 * per_step} of {n} samples" in texts(at)
    samples = next(d.value for d in at.dataframe if "completion" in d.value.columns)
    assert set(samples["step"]) == {3, 4, 5} and "score/math_answer" in samples.columns
    # the Weaver plan and the config
    plan = next(d.value for d in at.dataframe if "stage" in d.value.columns)
    assert list(plan["stage"]) == ["prep", "rollout", "reward", "update", "evaluate"]
    workers = next(d.value for d in at.dataframe if "ray node" in d.value.columns)
    assert set(workers["stage"]) == {"rollout", "reward", "update"}
    config = next(d.value for d in at.dataframe if list(d.value.columns) == ["key", "value"])
    assert config.set_index("key").loc["update.lr", "value"] == "0.001"


def test_compare_overlays_a_metric_and_diffs_configs(runs_copy, monkeypatch):
    make_variant(runs_copy, "dash-b", lr=5e-4)
    at = open_page(runs_copy, monkeypatch, "compare")
    assert sorted(at.multiselect[0].value) == ["dash-b", RUN]
    overlay = charts(at)["reward/mean"][0]
    by_run = overlay.groupby("run")["value"].mean()
    assert by_run["dash-b"] - by_run[RUN] == pytest.approx(0.5)  # the variant's rewards were shifted by +0.5
    metric = next(s for s in at.selectbox if s.label == "Metric")
    metric.set_value("train/grad_norm").run()
    assert "train/grad_norm" in charts(at)
    diff = next(d.value for d in at.dataframe if "key" in d.value.columns)
    assert diff.to_dict("records") == [{"key": "update.lr", RUN: "0.001", "dash-b": "0.0005"}]
    at.multiselect[0].set_value([RUN]).run()
    assert "pick two runs or more" in texts(at)


def test_checkpoints_page_without_prefect_shows_the_cli(tiny_run, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    at = open_page(tiny_run.parent, monkeypatch, "checkpoints")
    table = at.dataframe[0].value
    on_disk = sorted(p.name for p in (tiny_run / "checkpoints").glob("step-*"))
    assert list(table["checkpoint"]) == on_disk
    for _, row in table.iterrows():
        saved = json.loads((tiny_run / "checkpoints" / row["checkpoint"] / "checkpoint.json").read_text())
        assert row["eval pass@1"] == pytest.approx(saved["eval_pass@1"])
    assert "No Prefect server is configured (PREFECT_API_URL is not set)" in texts(at)
    assert f"forgeweave eval {tiny_run / 'checkpoints' / 'step-000012'}" in texts(at)
    assert len(at.button) == 0  # nothing to click without a server


@pytest.mark.parametrize("page", PAGES)
def test_pages_on_an_empty_runs_dir(tmp_path, monkeypatch, page):
    at = open_page(tmp_path / "runs", monkeypatch, page)  # does not even exist yet
    assert "No runs in" in texts(at) and "forgeweave run --preset tiny" in texts(at)
    assert not at.get("vega_lite_chart")
    assert not (tmp_path / "runs").exists()  # the dashboard only reads


def test_pages_on_a_half_written_run(runs_copy, monkeypatch):
    make_half_written(runs_copy / RUN, step=6)
    at = open_page(runs_copy, monkeypatch)
    row = at.dataframe[0].value.iloc[0]
    assert (row["status"], row["steps"], row["progress"]) == ("running", "6/12", 0.5)
    at.switch_page("views/run_detail.py").run()
    assert not at.exception
    assert _metric(at, "status") == "running" and _metric(at, "steps") == "6/12"
    # the copy's status.json was last written in 2001: a running run that old has probably been killed
    assert f"continue it with `forgeweave run --name {RUN} --resume`" in texts(at)
    assert at.toggle[0].value is True  # live refresh on by default while the run is running
    assert list(charts(at)["reward (mean ± std, per verifier)"][0]["step"]) == list(range(1, 7))
    at.switch_page("views/checkpoints.py").run()
    assert not at.exception and list(at.dataframe[0].value["checkpoint"]) == ["step-000004"]
    at.switch_page("views/compare.py").run()
    assert not at.exception


def test_a_run_with_nothing_but_a_status_file(tmp_path, monkeypatch):
    """The first instant of a run (or a run that failed in prep): status.json only."""
    run = tmp_path / "runs" / "starting"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "failed", "step": 0, "error": "UserError: bad data"}))
    for page in PAGES:
        at = open_page(tmp_path / "runs", monkeypatch, page)
        assert not at.exception, page
    at = open_page(tmp_path / "runs", monkeypatch, "run_detail")
    assert "failed at step 0: UserError: bad data" in texts(at)
    assert "no metrics yet" in texts(at) and "no samples yet" in texts(at) and "no plan.json" in texts(at)


def test_mlflow_run_id_is_shown(mlflow_store_dir, monkeypatch):
    runs, ids = mlflow_store_dir
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    at = open_page(runs, monkeypatch)
    assert at.dataframe[0].value.iloc[0]["MLflow run"] == ids["tagged"]
    at.switch_page("views/run_detail.py").run()
    assert _metric(at, "MLflow run") == ids["tagged"][:8] and ids["tagged"] in texts(at)


def test_a_growing_run_is_read_again_on_the_next_refresh(tiny_run, runs_copy, monkeypatch):
    """The loaders' cache is keyed on file mtimes and sizes: what a live run appends shows up on the next rerun."""
    run = runs_copy / RUN
    make_half_written(run, step=6)
    at = open_page(runs_copy, monkeypatch, "run_detail")
    assert _metric(at, "steps") == "6/12"
    # the trainer completes step 7: the torn line becomes a whole row, status.json moves on
    rows = read_metrics(tiny_run)[:8]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "status.json").write_text(json.dumps({"state": "running", "step": 7, "updated": time.time()}))
    at.run()
    assert _metric(at, "steps") == "7/12"
    assert "in progress" in texts(at) and "--resume" not in texts(at)  # just updated: not stale
    assert _metric(at, "last reward/mean") == f"{rows[7]['reward/mean']:.3f}"
    assert list(charts(at)["reward (mean ± std, per verifier)"][0]["step"]) == list(range(1, 8))


def test_a_distillation_run_shows_the_reverse_kl_by_step_and_by_position(runs_copy, monkeypatch):
    """A run with distill.teacher logs distill/reverse_kl and its profile over quarters of the sampled tokens
    (forge/rewards/teacher.py): the page draws the KL per step and the first vs last step's profile."""
    path = runs_copy / RUN / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows[1:]:  # step 0 is the initial evaluation: no rollouts, no teacher
        s = r["step"]
        r.update({"distill/reverse_kl": 1.0 / s, "time/teacher_s": 0.1,
                  **{f"distill/reverse_kl_q{q}": q / s for q in range(1, 5)}})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    at = open_page(runs_copy, monkeypatch, "run_detail")
    shown = charts(at)
    assert "Distillation (teacher)" in [s.value for s in at.subheader]
    kl = shown["reverse KL to the teacher (mean over sampled tokens)"][0]
    assert list(kl["value"]) == pytest.approx([1.0 / s for s in range(1, 13)])
    profile = shown["reverse KL to the teacher by position (first and last step)"][0]
    got = {(row.step, row.quarter): row.value for row in profile.itertuples()}
    assert got == pytest.approx({**{("step 1", f"quarter {q}"): q for q in range(1, 5)},
                                 **{("step 12", f"quarter {q}"): q / 12 for q in range(1, 5)}})  # fmt: skip
    assert "teacher seconds per step" in shown
    for r in rows[1:]:  # distill.topk: the top-k divergence the loss minimises, drawn beside it
        r["distill/topk_kl"] = 0.5 / r["step"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    title = "reverse KL to the teacher (mean over sampled tokens) and the weighted top-k one the loss minimises"
    kl = charts(open_page(runs_copy, monkeypatch, "run_detail"))[title][0]
    assert set(kl["metric"]) == {"distill/reverse_kl", "distill/topk_kl"}
