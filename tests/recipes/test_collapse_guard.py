"""Acceptance for the collapse guard (issue 17): label-free GRPO on the tiny model with a reward that gets gamed.

The reward is `tests.adversarial_verifiers:flip`: with reward.label_free it never sees the answers; it pays for the
true sum of "a+b=" until global step 10, then more for wrong answers (most for "4"). The prompts are the six sums
equal to 5, and the probe is a labelled file of the same. Measured here (seeds 0-5): probe pass@1 is 1.0 from step
5 (greedy "5"), the policy collapses onto wrong answers between steps 20 and 25 (probe 0.0, reward/mean 0.5 ->
0.6-0.75), and after a rollback to step 5 it collapses again within about 10 steps. The update settings make that
fast and repeatable: one completion token, 16 x 16 samples a step, a peak LR of 1e-2 reached by a 30-step warmup
(a small LR while the policy learns "5", so it still samples other answers when the reward turns), no adaptive LR.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from flows.cli import format_summary
from forge.checkpoint import load_state
from forge.presets import tiny
from forge.recipes.grpo import run
from forge.tracking import read_metrics

SUMS = [{"prompt": f"{a}+{5 - a}=", "answer": "5"} for a in range(6)]


def guard_cfg(tmp_path, action: str, steps: int = 40):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SUMS))
    cfg = tiny()
    cfg.steps, cfg.threads, cfg.tracking.mlflow = steps, 1, False
    cfg.data.source = cfg.data.eval_source = cfg.collapse.probe_source = str(data)
    r = cfg.reward
    r.verifiers, r.label_free = ["tests.adversarial_verifiers:flip"], True
    cfg.collapse.action, cfg.collapse.drop, cfg.collapse.max_rollbacks = action, 0.05, 1
    cfg.eval.verifiers, cfg.eval.every, cfg.eval.k = ["math_answer"], 5, 0  # the probe every 5 steps too
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 16, 16, 1
    u = cfg.update
    u.lr, u.warmup_steps, u.adaptive.enabled = 1e-2, 30, False
    cfg.checkpoint.every, cfg.checkpoint.keep_last = 0, 100  # guard checkpoints only (every probe step); keep them all
    return cfg


def weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


def optimizer_state(run_dir, step: int) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "checkpoints" / f"step-{step:06d}" / "state").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "guard.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rollback_run(tmp_path_factory):
    """One rollback run (about 25 s): its directory, summary and stderr lines."""
    tmp = tmp_path_factory.mktemp("guard")
    cfg, d = guard_cfg(tmp, "rollback"), tmp / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        summary = run(cfg, d, progress=False)
    return d, summary, err.getvalue().splitlines(), cfg


def test_rollback_restores_the_best_probe_checkpoint_and_the_run_ends_with_it(rollback_run):
    d, summary, err, _ = rollback_run
    first = events(d)[0]
    fired, best = first["step"], first["best_step"]
    assert first["action"] == "rollback" and best < fired
    assert first["probe_before"] - first["probe_after"] > 0.05 and first["reward_after"] > first["reward_before"]
    line = next(x for x in err if "collapse guard" in x)
    assert re.fullmatch(
        rf"forgeweave: step {fired}: collapse guard: probe pass@1 1\.00 -> 0\.\d\d while reward/mean 0\.\d\d -> "
        rf"0\.\d\d; rolled back to step {best} \(rollback 1 of 1\)", line
    ), line  # fmt: skip
    rows = {r["step"]: r for r in read_metrics(d / "metrics.jsonl")}
    probes = {s: r for s, r in rows.items() if "probe/pass@1" in r}
    assert set(probes) >= {0, 5, 10, fired} and all(s % 5 == 0 for s in probes)
    assert [probes[s]["guard/fired"] for s in sorted(probes) if s < fired] == [0.0] * len(
        [s for s in probes if s < fired]
    )
    assert (probes[fired]["guard/fired"], probes[fired]["guard/rollbacks"]) == (1.0, 1.0)
    assert probes[fired]["guard/rollback_to"] == best and probes[fired]["probe/pass@1"] == first["probe_after"]
    # right after the rollback (the checkpoint of the step it fired at) the trainer holds the best probe's weights and
    # optimizer state again, with the prompt sampler not rewound
    assert same(weights(d, fired), weights(d, best)) and same(optimizer_state(d, fired), optimizer_state(d, best))
    after, at_best = (
        load_state(d / "checkpoints" / f"step-{fired:06d}"),
        load_state(d / "checkpoints" / f"step-{best:06d}"),
    )
    assert after["trainer"]["policy_version"] == at_best["trainer"]["policy_version"] == best
    assert (
        after["sampler"]["cursor"] != at_best["sampler"]["cursor"]
        or after["sampler"]["epoch"] > at_best["sampler"]["epoch"]
    )
    assert not same(weights(d, fired - 5), weights(d, best))  # the weights before it were the collapsed ones
    # the run ends with the best probe's model: stopped by the next firing (max_rollbacks=1) with its weights, or
    # trained on to a final checkpoint whose probe is as good
    last = summary["steps"]
    assert (d / "checkpoints" / "latest").read_text().strip() == f"step-{last:06d}"
    score = json.loads((d / "checkpoints" / f"step-{last:06d}" / "checkpoint.json").read_text())["eval_pass@1"]
    assert score == summary["probe"]["best_pass@1"] == 1.0  # retention's score: the probe of the weights it holds
    if "stopped" in summary:
        assert events(d)[-1]["action"] == "stop" and summary["final_model_step"] == best
        assert same(weights(d, last), weights(d, best))
    assert summary["probe"] == {"best_step": best, "best_pass@1": 1.0, "rollbacks": 1, "guard_events": len(events(d))}


def test_stop_ends_the_run_with_the_best_probe_weights(tmp_path, capsys):
    cfg = guard_cfg(tmp_path, "stop")
    d = tmp_path / "run"
    summary = run(cfg, d, progress=False)
    (event,) = events(d)
    stopped, best = event["step"], event["best_step"]
    assert event["action"] == "stop" and stopped < cfg.steps
    assert summary["steps"] == stopped and summary["final_model_step"] == best
    assert summary["stopped"].startswith(f"step {stopped}: collapse guard: probe pass@1 1.00 -> ")
    assert summary["stopped"].endswith(f"; stopping: the run ends with the weights of step {best}")
    assert summary["stopped"] in capsys.readouterr().err
    assert json.loads((d / "status.json").read_text())["state"] == "finished"
    assert (d / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:06d}"
    assert same(weights(d, stopped), weights(d, best))
    assert (summary["eval"]["final"]["step"], summary["eval"]["final"]["pass@1"]) == (best, 1.0)  # those weights
    assert max(r["step"] for r in read_metrics(d / "metrics.jsonl")) == stopped
    shown = format_summary(summary)  # what `forgeweave run` prints at the end
    assert f"probe pass@1        best     1.000  (step {best}; guard firings 1, rollbacks 0)" in shown
    assert f"stopped early: {summary['stopped']}" in shown


def test_resume_after_the_guard_fired_is_exact(rollback_run, tmp_path):
    """Stopped right after the first rollback (its checkpoint), resumed: the same run as the uninterrupted one."""
    d, summary, _, cfg = rollback_run
    fired = events(d)[0]["step"]
    cut = guard_cfg(tmp_path, "rollback", steps=fired)
    run(cut, tmp_path / "run", progress=False)
    assert [e["action"] for e in events(tmp_path / "run")] == ["rollback"]
    again = run(guard_cfg(tmp_path, "rollback", steps=cfg.steps), tmp_path / "run", resume=True, progress=False)
    assert events(tmp_path / "run") == events(d)
    assert {k: again[k] for k in ("steps", "probe")} == {k: summary[k] for k in ("steps", "probe")}
    assert same(weights(tmp_path / "run", summary["steps"]), weights(d, summary["steps"]))
    mine = {r["step"]: r.get("reward/mean") for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert mine == {r["step"]: r.get("reward/mean") for r in read_metrics(d / "metrics.jsonl")}
