"""Tests for forge.config (overrides, YAML files, validation) and forge.presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.config import ConfigError, RunConfig, apply_overrides, dump_yaml, load_yaml
from forge.presets import PRESETS, get_preset


def one_line_error(fn, *args) -> str:
    """Run fn, expect a ConfigError, and return its message after checking it is one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------- overrides: values and types


def test_override_float_from_exponent_text():
    # PyYAML reads '1e-5' as a string (YAML 1.1 floats need a dot), so the dataclass type must coerce it.
    cfg = apply_overrides(RunConfig(), ["update.lr=1e-5"])
    assert cfg.update.lr == 1e-5 and type(cfg.update.lr) is float


def test_override_float_from_int_text_is_float():
    cfg = apply_overrides(RunConfig(), ["update.lr=1"])
    assert cfg.update.lr == 1.0 and type(cfg.update.lr) is float


def test_override_int():
    cfg = apply_overrides(RunConfig(), ["rollout.group_size=4"])
    assert cfg.rollout.group_size == 4 and type(cfg.rollout.group_size) is int


def test_override_top_level_field():
    assert apply_overrides(RunConfig(), ["steps=7"]).steps == 7


@pytest.mark.parametrize("raw", ["[a,b]", "a,b", "[a, b]", " a , b "])
def test_override_list_forms(raw):
    cfg = apply_overrides(RunConfig(), [f"reward.verifiers={raw}"])
    assert cfg.reward.verifiers == ["a", "b"]


def test_override_list_keeps_import_paths():
    cfg = apply_overrides(RunConfig(), ["reward.verifiers=[pkg.mod:fn, math_answer]"])
    assert cfg.reward.verifiers == ["pkg.mod:fn", "math_answer"]


def test_override_float_list_items_coerced():
    cfg = apply_overrides(RunConfig(), ["reward.weights=1,0.5"])
    assert cfg.reward.weights == [1.0, 0.5] and all(type(w) is float for w in cfg.reward.weights)


@pytest.mark.parametrize(("raw", "expected"), [("false", False), ("true", True), ("null", None)])
def test_override_optional_bool(raw, expected):
    cfg = apply_overrides(RunConfig(), [f"model.chat_template={raw}"])
    assert cfg.model.chat_template is expected


def test_override_literal_accepts_valid():
    cfg = apply_overrides(RunConfig(), ["update.schedule=cosine", "algo.loss=dapo", "model.dtype=bfloat16"])
    assert (cfg.update.schedule, cfg.algo.loss, cfg.model.dtype) == ("cosine", "dapo", "bfloat16")


def test_override_literal_rejects_invalid():
    msg = one_line_error(apply_overrides, RunConfig(), ["update.schedule=cosin"])
    assert "update.schedule" in msg and "'cosine'" in msg and "'cosin'" in msg


def test_override_str_field_keeps_text_as_typed():
    # YAML would read 0123 as the octal int 83, 1.10 as 1.1 and 'A: b' as a mapping; a str field keeps the text.
    cfg = apply_overrides(RunConfig(), ["model.path=0123", "data.source=1.10", "model.system_prompt=Answer: an int"])
    assert (cfg.model.path, cfg.data.source, cfg.model.system_prompt) == ("0123", "1.10", "Answer: an int")


def test_override_str_field_unquotes_yaml_strings():
    cfg = apply_overrides(RunConfig(), ['model.system_prompt="be brief"', "data.eval_source="])
    assert cfg.model.system_prompt == "be brief" and cfg.data.eval_source == ""


def test_override_value_may_contain_equals():
    cfg = apply_overrides(RunConfig(), ["data.prompt_template={a}{op}{b}="])
    assert cfg.data.prompt_template == "{a}{op}{b}="


# ---------------------------------------------------------------- overrides: errors for people


def test_unknown_key_suggests_nearest():
    msg = one_line_error(apply_overrides, RunConfig(), ["update.lrr=1"])
    assert "'update.lrr'" in msg and "'update.lr'" in msg


def test_unknown_section_suggests_nearest():
    msg = one_line_error(apply_overrides, RunConfig(), ["updat.lr=1"])
    assert "'updat'" in msg and "'update'" in msg


def test_value_used_as_section_is_rejected():
    msg = one_line_error(apply_overrides, RunConfig(), ["update.lr.x=1"])
    assert "'update.lr'" in msg and not msg.endswith(": ")


def test_wrong_type_names_key_and_type():
    msg = one_line_error(apply_overrides, RunConfig(), ["rollout.group_size=abc"])
    assert "'rollout.group_size'" in msg and "int" in msg and "'abc'" in msg


@pytest.mark.parametrize("raw", ["4.5", "true"])
def test_int_field_rejects_float_and_bool(raw):
    msg = one_line_error(apply_overrides, RunConfig(), [f"rollout.group_size={raw}"])
    assert "rollout.group_size" in msg


def test_bool_field_rejects_other_text():
    msg = one_line_error(apply_overrides, RunConfig(), ["update.adaptive.enabled=maybe"])
    assert "'update.adaptive.enabled'" in msg and "bool" in msg


def test_list_item_error_names_index():
    msg = one_line_error(apply_overrides, RunConfig(), ["reward.weights=1,x"])
    assert "reward.weights[1]" in msg and "float" in msg


def test_section_set_to_scalar_is_rejected():
    msg = one_line_error(apply_overrides, RunConfig(), ["update=1"])
    assert "'update'" in msg and "mapping" in msg


def test_missing_equals_is_clear():
    msg = one_line_error(apply_overrides, RunConfig(), ["update.lr"])
    assert "'update.lr'" in msg and "key=value" in msg


# ---------------------------------------------------------------- YAML files


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_round_trip_every_preset(tmp_path: Path, name: str):
    cfg = get_preset(name)
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_yaml(path) == cfg


def test_yaml_round_trip_after_overrides(tmp_path: Path):
    cfg = apply_overrides(RunConfig(), ["update.lr=1e-5", "model.chat_template=null", "reward.weights=[0.5]"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_yaml(path) == cfg


def test_partial_yaml_keeps_defaults(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\nupdate:\n  lr: 1e-5\n")
    cfg = load_yaml(path)
    assert cfg.steps == 3 and cfg.update.lr == 1e-5 and cfg.rollout == RunConfig().rollout


def test_empty_yaml_is_defaults(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    assert load_yaml(path) == RunConfig()


def test_yaml_unknown_key_names_file_and_key(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("update:\n  lrr: 0.1\n")
    msg = one_line_error(load_yaml, path)
    assert str(path) in msg and "'update.lrr'" in msg and "'update.lr'" in msg


def test_yaml_wrong_type_names_file_and_key(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  group_size: many\n")
    msg = one_line_error(load_yaml, path)
    assert str(path) in msg and "'rollout.group_size'" in msg


def test_yaml_section_not_mapping(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("update: 3\n")
    msg = one_line_error(load_yaml, path)
    assert str(path) in msg and "'update'" in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("steps: 3\nupdate: [1, 2\n")
    msg = one_line_error(load_yaml, path)
    assert str(path) in msg and "YAML" in msg and "line" in msg


def test_yaml_missing_file(tmp_path: Path):
    msg = one_line_error(load_yaml, tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "does not exist" in msg


# ---------------------------------------------------------------- validate


def test_validate_group_size_one():
    cfg = apply_overrides(RunConfig(), ["rollout.group_size=1"])
    msg = one_line_error(cfg.validate)
    assert "'rollout.group_size'" in msg and ">= 2" in msg


def test_validate_weights_length_mismatch():
    cfg = apply_overrides(RunConfig(), ["reward.verifiers=[math_answer,format_integer]", "reward.weights=[1.0]"])
    msg = one_line_error(cfg.validate)
    assert "'reward.weights'" in msg and "1 values for 2 verifiers" in msg


def test_validate_no_verifiers():
    cfg = apply_overrides(RunConfig(), ["reward.verifiers=[]"])
    assert "'reward.verifiers'" in one_line_error(cfg.validate)


def test_validate_returns_config():
    cfg = RunConfig()
    assert cfg.validate() is cfg


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_validates(name: str):
    cfg = get_preset(name)
    assert isinstance(cfg, RunConfig) and cfg.preset == name
    cfg.validate()


def test_presets_are_fresh_objects():
    a = get_preset("tiny")
    a.reward.verifiers.append("x")
    assert get_preset("tiny").reward.verifiers == ["math_answer"]


def test_unknown_preset_suggests():
    msg = one_line_error(get_preset, "tinyy")
    assert "'tinyy'" in msg and "'tiny'" in msg and "smollm2-arith" in msg
