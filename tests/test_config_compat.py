"""Keys of earlier releases (forge/config_compat.py): each old key loads from YAML and `--set` to its new place with
one stderr note, a config.yaml written by the previous release loads to the same values, and a run whose
config.yaml is in the old layout resumes with no spurious change recorded."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from forge import config_compat
from forge.config import ConfigError, RunConfig, apply_overrides, describe_keys, from_dict, load_yaml, overlay, to_dict
from forge.config_compat import RENAMED

FIXTURE = Path(__file__).parent / "fixtures" / "config_v1.yaml"  # `forgeweave config show` of the release before

# old key -> (override text, the value the new key gets): each differs from the default
OLD_VALUES = {
    "model.tiny_hidden": ("48", 48),
    "model.tiny_layers": ("3", 3),
    "model.tiny_head_dim": ("32", 32),
    "rollout.vllm_python": ("/opt/v/bin/python", "/opt/v/bin/python"),
    "rollout.vllm_kv_cache_gib": ("4", 4),
    "rollout.vllm_start_timeout_s": ("30", 30.0),
    "rollout.vllm_dtype": ("bfloat16", "bfloat16"),
    "rollout.vllm_gpu_memory_utilization": ("0.3", 0.3),
    "rollout.vllm_enforce_eager": ("true", True),
    "rollout.vllm_max_model_len": ("2048", 2048),
    "rollout.vllm_sleep": ("off", "off"),
    "reward.window_steps": ("4", 4),
    "reward.refit_every": ("2", 2),
    "reward.ensemble_model": ("latent_class", "latent_class"),
    "reward.ensemble_classes": ("4", 4),
    "reward.necessary_checks": ("[parity_check]", ["parity_check"]),
    "reward.collapse_action": ("rollback", "rollback"),
    "reward.collapse_drop": ("0.1", 0.1),
    "reward.max_rollbacks": ("5", 5),
    "reward.code_timeout_s": ("7.5", 7.5),
    "reward.code_test_timeout_s": ("1.5", 1.5),
    "reward.code_memory_mb": ("512", 512),
    "reward.code_max_procs": ("4", 4),
    "reward.code_workers": ("3", 3),
    "reward.allow_network_code": ("true", True),
    "update.adaptive": ("false", False),
    "update.adaptive_signal": ("kl", "kl"),
    "update.adaptive_target": ("3.0", 3.0),
    "update.adaptive_cut": ("0.25", 0.25),
    "update.adaptive_recover": ("1.2", 1.2),
    "eval.check": ("code_exec", ["code_exec"]),
    "eval.probe_source": ("probe.jsonl", "probe.jsonl"),
    "eval.probe_every": ("3", 3),
    "eval.probe_max_problems": ("50", 50),
    "env.openenv_url": ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    "env.openenv_app": ("pkg.mod:app", "pkg.mod:app"),
    "env.openenv_command": ("serve --port {port}", "serve --port {port}"),
    "env.openenv_text_action": ("message", "message"),
    "env.openenv_max_sessions": ("4", 4),
    "env.openenv_timeout_s": ("5.0", 5.0),
    "env.openenv_start_timeout_s": ("90", 90.0),
    "env.agent": ("my_agents:agent", "my_agents:agent"),
    "env.agent_timeout_s": ("30", 30.0),
    "env.agent_max_concurrent": ("2", 2),
    "env.agent_batch_wait_ms": ("1.5", 1.5),
    "env.agent_request_sampling": ("true", True),
    "reward.teacher": ("/models/teacher", "/models/teacher"),
    "reward.teacher_weight": ("0.5", 0.5),
    "reward.teacher_discount": ("0.9", 0.9),
    "reward.teacher_topk": ("16", 16),
    "reward.teacher_divergence": ("forward", "forward"),
}
# keys of sections the previous release (the fixture's) did not have: renamed since, absent from its files
SINCE_V1 = ("env.", "reward.teacher")


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Each test sees the notes again (they are printed once per key per process)."""
    monkeypatch.setattr(config_compat, "_noted", set())


def get(cfg: RunConfig, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def note(old: str) -> str:
    return f"forgeweave: config key '{old}' is now '{RENAMED[old]}'"


def test_every_old_key_is_tested_and_maps_to_an_existing_key():
    assert set(OLD_VALUES) == set(RENAMED)
    keys = {d.key for d in describe_keys()}
    assert set(RENAMED.values()) <= keys
    assert not set(RENAMED) & keys  # no old key is still a key


@pytest.mark.parametrize("old", list(OLD_VALUES))
def test_old_key_via_set_gives_the_note_and_the_new_value(old, capsys):
    raw, expected = OLD_VALUES[old]
    cfg = apply_overrides(RunConfig(), [f"{old}={raw}"])
    assert get(cfg, RENAMED[old]) == expected and get(cfg, RENAMED[old]) != get(RunConfig(), RENAMED[old])
    assert capsys.readouterr().err.splitlines() == [note(old)]
    apply_overrides(RunConfig(), [f"{old}={raw}"])
    assert capsys.readouterr().err == ""  # once per key per process


@pytest.mark.parametrize("old", list(OLD_VALUES))
def test_old_key_via_yaml_gives_the_note_and_the_new_value(old, tmp_path, capsys):
    raw, expected = OLD_VALUES[old]
    section, name = old.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {raw}\n")
    assert get(load_yaml(path), RENAMED[old]) == expected
    assert get(overlay(RunConfig(), yaml.safe_load(path.read_text())), RENAMED[old]) == expected
    assert capsys.readouterr().err.splitlines() == [note(old)]


def test_old_and_new_key_together_is_an_error():
    with pytest.raises(ConfigError, match="'rollout.vllm_sleep' is the old name of 'rollout.vllm.sleep': set only one"):
        from_dict({"rollout": {"vllm_sleep": "on", "vllm": {"sleep": "off"}}})
    # the new section and the old scalar's other keys mix: adaptive_target lands in the section
    cfg = from_dict({"update": {"adaptive": {"enabled": False}, "adaptive_target": 3.0}})
    assert (cfg.update.adaptive.enabled, cfg.update.adaptive.target) == (False, 3.0)
    with pytest.raises(ConfigError, match="'reward.teacher_topk' is the old name of 'distill.topk': set only one"):
        from_dict({"reward": {"teacher_topk": 4}, "distill": {"topk": 8}})


def test_the_env_and_distill_sections_load_from_the_old_keys(capsys):
    """env.openenv_* -> env.openenv.*, env.agent (a string) and env.agent_* -> env.agent.*, reward.teacher* ->
    distill.*: a file in the old layout and the same settings by --set give one config, the new layout's."""
    old = {"env": {"agent": "my_agents:agent", "agent_timeout_s": 30.0, "openenv_timeout_s": 5.0},
           "reward": {"verifiers": [], "teacher": "/t", "teacher_topk": 8, "teacher_weight": 0.5}}  # fmt: skip
    cfg = from_dict(old)
    assert (cfg.env.agent.fn, cfg.env.agent.timeout_s, cfg.env.openenv.timeout_s) == ("my_agents:agent", 30.0, 5.0)
    assert (cfg.distill.teacher, cfg.distill.topk, cfg.distill.weight) == ("/t", 8, 0.5)
    sets = ["env.agent=my_agents:agent", "env.agent_timeout_s=30", "env.openenv_timeout_s=5", "reward.verifiers=[]",
            "reward.teacher=/t", "reward.teacher_topk=8", "reward.teacher_weight=0.5"]  # fmt: skip
    assert to_dict(apply_overrides(RunConfig(), sets)) == to_dict(cfg)
    assert "forgeweave: config key 'env.agent' is now 'env.agent.fn'" in capsys.readouterr().err
    # the new section beside an old key of it: the old key lands in the section; a new-layout file is left alone
    cfg = from_dict({"env": {"agent": {"fn": "m:f"}, "agent_max_concurrent": 2}})
    assert (cfg.env.agent.fn, cfg.env.agent.max_concurrent) == ("m:f", 2)
    capsys.readouterr()
    assert from_dict({"env": {"agent": {"fn": "m:f"}}}).env.agent.fn == "m:f" and capsys.readouterr().err == ""


def test_unknown_keys_still_suggest_names():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.vllm.pyton'; did you mean 'rollout.vllm.python"):
        apply_overrides(RunConfig(), ["rollout.vllm.pyton=x"])
    with pytest.raises(ConfigError, match=r"key 'update.adaptive.tagret'; did you mean .*'update.adaptive.target'"):
        from_dict({"update": {"adaptive": {"tagret": 1.0}}})
    with pytest.raises(ConfigError, match=r"unknown config section 'colapse'; did you mean 'collapse'"):
        apply_overrides(RunConfig(), ["colapse.action=warn"])


def test_config_keys_shows_the_nested_keys(capsys):
    assert main(["config", "keys", "rollout.vllm"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0].split()
    assert first[:4] == ["rollout.vllm.python", "str", "=", '""'] and first[4:7] == ["Python", "of", "the"]
    assert len(out.splitlines()) == 8
    assert main(["config", "keys"]) == 0
    keys = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"model.tiny.hidden", "reward.code_exec.workers", "reward.ensemble.classes", "update.adaptive.enabled",
            "collapse.action", "collapse.probe_source"} <= keys  # fmt: skip
    assert not {"rollout.vllm_python", "eval.check", "reward.collapse_action"} & keys


def test_a_config_yaml_of_the_previous_release_loads_to_the_same_values(capsys):
    cfg = load_yaml(FIXTURE).validate()
    err = capsys.readouterr().err.splitlines()
    v1 = [old for old in RENAMED if not old.startswith(SINCE_V1)]  # the renames of keys that release had
    assert set(err) == {note(old) for old in v1} and len(err) == len(v1)
    assert (cfg.model.tiny.hidden, cfg.model.tiny.layers, cfg.model.tiny.head_dim) == (32, 1, 16)
    vllm, code = cfg.rollout.vllm, cfg.reward.code_exec
    assert (vllm.python, vllm.kv_cache_gib, vllm.sleep) == ("/opt/vllm/bin/python", 2, "off")
    assert (code.timeout_s, code.workers, code.allow_network) == (7.5, 3, True)
    assert (cfg.reward.ensemble.window_steps, cfg.reward.ensemble.classes) == (5, 4)
    adaptive = cfg.update.adaptive
    assert (adaptive.enabled, adaptive.signal, adaptive.target) == (True, "kl", 3.0)
    assert (adaptive.cut, adaptive.recover) == (0.25, 1.1)
    assert (cfg.collapse.action, cfg.collapse.drop, cfg.collapse.max_rollbacks) == ("rollback", 0.1, 3)
    assert (cfg.collapse.probe_every, cfg.collapse.probe_max_problems, cfg.collapse.probe_source) == (2, 50, "")
    assert cfg.eval.verifiers == ["math_answer"]  # eval.check: math_answer
    # every other key has the value the old file gives it: the old layout of this config is the file itself
    old = yaml.safe_load(FIXTURE.read_text())
    old["eval"]["verifiers"], old["eval"]["check"] = ["math_answer"], ""
    assert old_layout(to_dict(cfg)) == old


# keys that release did not have; a saved config gets the default
ADDED_SINCE = ["orchestration.reserve_timeout_s", "rollout.weight_transport", "rollout.weight_check"]


def old_layout(new: dict) -> dict:
    """A config dict in the previous release's layout (fields added since, with their defaults, dropped)."""
    data = copy.deepcopy(new)
    defaults = to_dict(RunConfig())
    assert data.pop("env") == defaults["env"]  # the section came after that release: its defaults only
    assert data.pop("distill") == defaults["distill"]  # so did distillation (as reward.teacher*)
    for old, key in reversed(RENAMED.items()):  # the adaptive_* keys leave update.adaptive before it turns scalar
        if old.startswith(SINCE_V1):
            continue
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        value = node.pop(leaf)
        section, name = old.split(".")
        data[section][name] = value if old != "eval.check" else ""
        if old == "eval.check":
            data["eval"]["verifiers"] = value
    for section, name in [("model", "tiny"), ("rollout", "vllm"), ("reward", "ensemble"), ("reward", "code_exec")]:
        assert data[section].pop(name) == {}
    assert data.pop("collapse") == {}
    for key in ADDED_SINCE:
        section, name = key.split(".")
        assert data[section].pop(name) == defaults[section][name]
    return data


def test_a_run_with_an_old_config_yaml_resumes_with_no_spurious_change(runs_dir, capsys):
    settings = ["steps=2", "threads=1", "checkpoint.every=1", "eval.every=0", "eval.k=0", "eval.max_problems=8",
                "rollout.prompts_per_step=2", "rollout.group_size=2", "tracking.mlflow=false", "model.tiny.hidden=32",
                "model.tiny.layers=1", "update.adaptive.target=3.0", "collapse.action=stop"]  # fmt: skip
    args = ["run", "--preset", "tiny", "--name", "old", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    assert main(args + [a for s in settings for a in ("--set", s)]) == 0
    run = runs_dir / "old"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    old = old_layout(saved)
    assert _keys(old) == _keys(yaml.safe_load(FIXTURE.read_text()))  # the layout the previous release wrote
    (run / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    capsys.readouterr()
    resume = ["run", "--name", "old", "--resume", "--runs-dir", str(runs_dir), "--quiet", "--no-prefect"]
    assert main(resume + ["--set", "steps=3"]) == 0
    assert note("update.adaptive_target") in capsys.readouterr().err
    changes = [json.loads(line)["changes"] for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert changes == [{"steps": [2, 3]}]
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    resumed = yaml.safe_load((run / "config.yaml").read_text())
    assert resumed == {**saved, "steps": 3}  # rewritten in the new layout, the same values


def _keys(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        out |= _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out
