"""forge.guard (the collapse guard's rule, worked by hand), its config keys, and the probe split of the prep stage.

The end-to-end runs (an adversarial verifier that games the reward, rollback / stop / resume) are in
tests/recipes/test_collapse_guard.py.
"""

from __future__ import annotations

import json

import pytest

from forge.compose import data_sources
from forge.config import ConfigError, RunConfig, apply_overrides, config_diff, from_dict
from forge.data import check_data_hash, content_hash, prepare, read_probe, read_split
from forge.errors import UserError
from forge.guard import CollapseGuard
from forge.resume import check_resume_changes


def feed(guard: CollapseGuard, rewards: dict[int, float]) -> CollapseGuard:
    for step, reward in rewards.items():
        guard = guard.observe(step, reward)
    return guard


def warmed(action: str = "warn", **kw) -> CollapseGuard:
    """Best probe 0.40 at step 2 with R_at_b = mean(0.2, 0.3) = 0.25 (the probe interval (0, 2])."""
    g, event = CollapseGuard(action, **kw).probe(0, 0.0)
    assert event is None
    g, event = feed(g, {1: 0.2, 2: 0.3}).probe(2, 0.40)
    assert event is None
    assert (g.best_step, g.best, g.reward_at_best) == (2, 0.40, pytest.approx(0.25))
    return g


# ---------------------------------------------------------------- the rule


def test_fires_when_probe_falls_and_reward_rises():
    g = feed(warmed(), {3: 0.5, 4: 0.7})  # R_since = (0.5 + 0.7) / 2 = 0.6 > 0.25; 0.40 - 0.20 = 0.20 > 0.05
    before = g
    g, event = g.probe(4, 0.20)
    assert before.events == () and before.held == (2, 0.40)  # a guard is data: probing returns a new one
    assert (event.action, event.step, event.best_step) == ("warn", 4, 2)
    assert (event.probe_before, event.probe_after) == (0.40, 0.20)
    assert (event.reward_before, event.reward_after) == (pytest.approx(0.25), pytest.approx(0.6))
    assert (
        event.line() == "forgeweave: step 4: collapse guard: probe pass@1 0.40 -> 0.20 while reward/mean 0.25 -> 0.60"
    )
    assert list(g.events) == [json.loads(json.dumps(e)) for e in g.events] and g.events[0]["action"] == "warn"
    assert g.metrics(event) == {"guard/fired": 1.0, "guard/rollbacks": 0.0}


def test_no_fire_when_the_reward_fell_too():
    g = feed(warmed(), {3: 0.2, 4: 0.1})  # R_since = 0.15 < 0.25: training got worse, the reward is not being gamed
    g, event = g.probe(4, 0.0)
    assert event is None
    assert g.metrics(None) == {"guard/fired": 0.0, "guard/rollbacks": 0.0}


def test_no_fire_within_the_allowed_drop():
    g, event = feed(warmed(drop=0.05), {3: 0.9, 4: 0.9}).probe(4, 0.36)
    assert event is None  # 0.40 - 0.36 = 0.04 <= 0.05
    g, event = feed(g, {5: 0.9, 6: 0.9}).probe(6, 0.34)
    assert event.action == "warn"  # 0.06 > 0.05; R_since = 0.9 over steps 3..6 (the best is still step 2)


def test_best_is_the_first_probe_to_reach_it_and_warn_keeps_it():
    g, event = feed(warmed(), {3: 0.4, 4: 0.4}).probe(4, 0.40)
    assert event is None and g.best_step == 2  # an equal probe does not replace the best
    g, event = feed(g, {5: 0.6, 6: 0.6}).probe(6, 0.50)
    assert event is None and (g.best_step, g.best) == (6, 0.50)  # a higher one does
    assert g.reward_at_best == pytest.approx(0.6)  # R_at_b: the interval (4, 6]
    g, event = feed(g, {7: 0.9}).probe(7, 0.1)
    assert event.action == "warn"
    g, event = feed(g, {8: 0.9}).probe(8, 0.1)
    assert event.action == "warn" and g.best_step == 6  # warn changes nothing: it fires again


def test_step0_best_compares_with_the_first_steps_reward():
    g, _ = CollapseGuard("warn").probe(0, 0.5)  # a pretrained policy that starts best
    g = feed(g, {1: 0.3, 2: 0.6, 3: 0.9})  # R_at_b = step 1's reward (sampled from the step-0 policy) = 0.3
    g, event = g.probe(3, 0.1)  # R_since = (0.3 + 0.6 + 0.9) / 3 = 0.6 > 0.3
    assert (event.best_step, event.reward_before, event.reward_after) == (0, 0.3, pytest.approx(0.6))


def test_rollbacks_then_stop():
    g, event = feed(warmed("rollback", max_rollbacks=1), {3: 0.9, 4: 0.9}).probe(4, 0.0)
    assert (event.action, g.rollbacks, g.held, g.since) == ("rollback", 1, (4, 0.40), (0.0, 0))
    assert event.line().endswith("; rolled back to step 2 (rollback 1 of 1)")
    assert g.metrics(event) == {"guard/fired": 1.0, "guard/rollbacks": 1.0, "guard/rollback_to": 2.0}
    assert g.score_at(4) == 0.40 and g.score_at(2) is None  # the weights held at step 4 are the best's again
    g, event = feed(g, {5: 0.3}).probe(5, 0.0)  # after the rollback R_since starts again: 0.3 > 0.25
    assert event.action == "stop" and g.rollbacks == 1
    assert event.line().endswith("; stopping: the run ends with the weights of step 2")
    assert g.summary("why") == {
        "probe": {"best_step": 2, "best_pass@1": 0.40, "rollbacks": 1, "guard_events": 2},
        "stopped": "why",
        "final_model_step": 2,
    }


def test_off_never_fires_and_a_first_probe_never_does():
    g, event = CollapseGuard("off").probe(0, 1.0)
    assert event is None
    g, event = feed(g, {1: 0.9}).probe(1, 0.0)
    assert event is None and g.best == 1.0
    assert CollapseGuard("stop").probe(5, 0.0)[1] is None


def test_state_dict_round_trips_through_json():
    g = feed(warmed("rollback"), {3: 0.6})
    restored = CollapseGuard("rollback").loaded(json.loads(json.dumps(g.state_dict())))
    assert restored == g and restored.state_dict() == g.state_dict()
    g, restored = feed(g, {4: 0.8}), feed(restored, {4: 0.8})
    assert restored.probe(4, 0.0) == g.probe(4, 0.0)
    assert restored.loaded(None) == restored  # a checkpoint written without a probe: nothing changes


# ---------------------------------------------------------------- config


def test_config_keys_and_checks():
    cfg = apply_overrides(RunConfig(), ["collapse.action=off", "collapse.probe_every=5"])
    assert cfg.collapse.action == "off"  # YAML would read `off` as False
    assert from_dict({"collapse": {"action": False}}).collapse.action == "off"  # `off` in a YAML file
    with pytest.raises(ConfigError, match="'collapse.drop' must be in"):
        apply_overrides(RunConfig(), ["collapse.drop=1.5"]).validate()
    bad = apply_overrides(RunConfig(), ["collapse.probe_source=p.jsonl", "collapse.action=rollback"])
    bad.checkpoint.keep_best = 0
    with pytest.raises(ConfigError, match="'checkpoint.keep_best' is 0, but collapse.action=rollback needs"):
        bad.validate()
    bad.collapse.action = "warn"
    bad.validate()  # warn restores nothing


def test_probe_source_cannot_change_on_resume():
    old, new = RunConfig(), RunConfig()
    new.collapse.probe_source = "probe.jsonl"
    with pytest.raises(ConfigError, match="'collapse.probe_source' cannot change on --resume"):
        check_resume_changes(config_diff(old, new), 10, 30)
    new.collapse.probe_source, new.collapse.probe_every, new.collapse.action = "", 3, "stop"
    check_resume_changes(config_diff(old, new), 10, 30)  # the guard's other keys may change


# ---------------------------------------------------------------- the probe split


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def probe_cfg(tmp_path, rows=None) -> RunConfig:
    cfg = RunConfig(seed=1)
    cfg.data.train_size, cfg.data.eval_size, cfg.data.digits = 20, 5, 1
    rows = (
        rows if rows is not None else [{"prompt": "2+3=", "answer": 5, "id": "p1"}, {"prompt": "1+1=", "answer": "2"}]
    )
    cfg.collapse.probe_source = str(write_jsonl(tmp_path / "probe.jsonl", rows))
    return cfg


def prep(cfg, run_dir):
    return prepare(data_sources(cfg), run_dir, lambda p: p, lambda s: len(s))


def test_prep_writes_the_probe_split_and_hashes_it(tmp_path):
    cfg = probe_cfg(tmp_path)
    data = prep(cfg, tmp_path / "run")
    probe = read_probe(tmp_path / "run")
    assert probe == data.probe and [r["id"] for r in probe] == ["p1", "probe-2"]
    assert [(r["prompt"], r["model_input"], r["answer"]) for r in probe] == [
        ("2+3=",) * 2 + ("5",),
        ("1+1=",) * 2 + ("2",),
    ]
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert (manifest["probe_rows"], manifest["probe_source"]) == (2, cfg.collapse.probe_source)
    train, eval_ = read_split(tmp_path / "run", "train"), read_split(tmp_path / "run", "eval")
    assert manifest["content_hash"] == content_hash(train, eval_, probe) != content_hash(train, eval_)
    assert check_data_hash(tmp_path / "run", train, eval_, probe=probe) == manifest["content_hash"]
    with pytest.raises(UserError, match="the train/eval/probe splits changed since data/manifest.json"):
        check_data_hash(tmp_path / "run", train, eval_, probe=[{**probe[0], "answer": "6"}, probe[1]])
    # without a probe: no probe.parquet (a stale one is removed) and the hash is the old two-split one
    cfg.collapse.probe_source = ""
    prep(cfg, tmp_path / "run")
    assert read_probe(tmp_path / "run") is None
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert "probe_rows" not in manifest and manifest["content_hash"] == content_hash(train, eval_)


def test_probe_mistakes_are_one_line(tmp_path):
    cfg = probe_cfg(tmp_path)
    cfg.collapse.probe_source = str(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match=r"^collapse.probe_source '.*nope.jsonl' does not exist; point it at a labelled"):
        prep(cfg, tmp_path / "run")
    cfg = probe_cfg(tmp_path, [{"prompt": "2+3=", "answer": "5"}, {"prompt": "1+1="}])
    with pytest.raises(UserError, match=r"probe.jsonl: 1 invalid row \(row 2: missing field 'answer'\)"):
        prep(cfg, tmp_path / "run")
