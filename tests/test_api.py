"""forge.train, the Python API (issue 13): config forms, datasets as objects saved into the run, callables as
reward functions, and resuming such a run (CLI refused with a one-line error; forge.train with the functions)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import forge
from flows.cli import main
from forge.config import RunConfig
from forge.errors import UserError
from forge.tracking import NullTracker

TINY = ["threads=1", "checkpoint.every=1", "eval.every=0", "eval.k=0", "eval.max_problems=4", "rollout.group_size=2",
        "rollout.prompts_per_step=2", "model.tiny.hidden=32", "model.tiny.layers=1", "data.eval_size=2"]  # fmt: skip


def make_reward():
    def length_reward(completions, n, **kwargs):  # a closure: its qualname cannot be imported
        assert all(type(v) is int for v in n)
        return [float(len(c)) / 3 for c in completions]

    return length_reward


ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "n": i} for i in range(8)]


def test_train_saves_the_dataset_into_the_run_and_records_the_callables(tmp_path, capsys):
    reward = make_reward()
    summary = forge.train(dataset=ROWS, reward_funcs=["math_answer", reward], run_dir=tmp_path / "r",
                          overrides=["steps=2", *TINY], progress=False)  # fmt: skip
    assert summary["steps"] == 2 and summary["execution"] == "embedded"
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["data"]["source"] == str((tmp_path / "r" / "inputs" / "train").resolve())
    spec = "tests.test_api:make_reward.<locals>.length_reward"
    assert saved["reward"]["verifiers"] == ["math_answer", spec] and saved["reward"]["callables"] == [spec]
    assert (tmp_path / "r" / "inputs" / "train" / "state.json").is_file()  # a datasets save_to_disk directory
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert '"reward/length_reward/mean"' in metrics and '"reward/length_reward/errors": 0.0' in metrics

    # the CLI cannot import a closure: one line saying how to resume, nothing changed
    capsys.readouterr()
    assert main(["run", "--name", "r", "--runs-dir", str(tmp_path), "--resume", "--no-prefect", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("forgeweave: error: this run's reward functions " + spec)
    assert "resume it through forge.train(..., resume=True, reward_funcs=[...]) with the same functions" in err

    with pytest.raises(UserError, match="pass the same functions in the same order"):
        forge.train(run_dir=tmp_path / "r", resume=True, reward_funcs=[reward], overrides=["steps=3"])
    with pytest.raises(UserError, match="cannot be imported here; resume it through forge.train"):
        forge.train(run_dir=tmp_path / "r", resume=True, overrides=["steps=3"])
    built, steps = [], []

    class Recorder(NullTracker):
        def log_metrics(self, metrics, step):
            steps.append(step)

    def factory(cfg, run_dir):  # as flows.tracking.trackers_for_run: called with the run's final config
        built.append((cfg.steps, run_dir))
        return Recorder()

    resumed = forge.train(run_dir=tmp_path / "r", resume=True, reward_funcs=["math_answer", reward],
                          overrides=["steps=3"], progress=False, tracker=factory)  # fmt: skip
    assert resumed["steps"] == 3
    assert built == [(3, tmp_path / "r")] and 3 in steps


def test_config_forms():
    from forge.api import _base_config

    cfg = _base_config({"steps": 7, "rollout": {"group_size": 4}}, "tiny")
    assert (cfg.preset, cfg.steps, cfg.rollout.group_size, cfg.rollout.prompts_per_step) == ("tiny", 7, 4, 16)
    assert _base_config({"steps": 7}, None).model.chat_template is None  # no preset: the defaults
    with pytest.raises(UserError, match="unknown config key 'rollout.group'"):
        _base_config({"rollout": {"group": 4}}, "tiny")
    with pytest.raises(UserError, match="either a RunConfig or a preset"):
        _base_config(RunConfig(), "tiny")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset": "data.jsonl"}, "dataset must be a datasets.Dataset, a DatasetDict or a non-empty list of dicts"),
        ({"dataset": [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": "x"}]}, "one type per column"),
        ({"reward_funcs": [42]}, r"reward_funcs\[0\] is a int"),
        ({"overrides": ["rollout.backend=vllm"]}, "forge.train runs every stage in this process"),
        ({"resume": True}, "needs run_dir"),
        ({"tracker": 42}, "tracker must be a Tracker or a callable"),
    ],
)
def test_bad_arguments_are_one_line_user_errors(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        forge.train(**{"run_dir": None if kwargs.get("resume") else tmp_path / "r", **kwargs})


def test_import_forge_stays_light():
    code = "import sys, forge; print('forge.api' in sys.modules, 'datasets' in sys.modules, callable(forge.train))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False", "True"], out.stderr[-2000:]
