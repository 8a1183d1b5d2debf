"""`forgeweave config keys/show`, the preset + YAML overlay, and which keys a resume may change (issue 13)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from flows.runs import resolve_config, resolve_run
from forge.config import (
    ConfigError,
    RunConfig,
    config_diff,
    describe_keys,
    dump_yaml,
    field_docs,
    load_yaml,
)
from forge.errors import UserError
from forge.presets import PRESETS, compose, get_preset
from forge.resume import RESUME_FIXED, check_resume_changes

# ---------------------------------------------------------------- config keys


def test_every_config_field_has_a_one_line_doc():
    """A new key must come with the docstring `config keys` shows (nested sections included)."""
    docs = describe_keys()
    missing = [d.key for d in docs if not d.doc]
    assert not missing, f"config fields without a docstring under them in forge/config.py: {missing}"
    assert all("\n" not in d.doc and d.doc == d.doc.strip() for d in docs)
    assert len({d.key for d in docs}) == len(docs)


def test_keys_cover_every_leaf_with_its_type_and_default():
    docs = {d.key: d for d in describe_keys()}
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.setdefault(f"{prefix}{k}", v)

    walk({k: v for k, v in yaml.safe_load(dump_yaml(RunConfig())).items() if k != "pools"})
    assert set(docs) == set(flat) | {"pools"}
    assert docs["update.lr"].type == "float" and docs["update.lr"].default == 1e-3
    assert docs["update.lr"].doc == "Peak learning rate (AdamW)."
    assert docs["rollout.backend"].type == "'hf' | 'vllm'" and docs["rollout.backend"].default == "hf"
    assert docs["model.chat_template"].type == "bool | None"
    assert docs["data.operations"].type == "list[str]" and docs["data.operations"].default == ["+"]
    # a docstring wrapped over two lines is joined onto one
    assert docs["data.eval_overlap"].doc.startswith("Arithmetic: eval is a sample of the whole problem space")
    assert "the manifest counts the overlap." in docs["data.eval_overlap"].doc


@dataclass
class _Inner:
    rank: int = 8
    """Adapter rank."""
    modules: list[str] = field(default_factory=lambda: ["q_proj"])
    """Modules to adapt,
    wrapped over lines."""


@dataclass
class _Outer:
    path: str = "m"
    """Model path."""
    lora: _Inner = field(default_factory=_Inner)
    """The adapter."""
    undocumented: int = 0


def test_nested_dataclasses_are_listed_as_dotted_keys():
    """model.lora.* (another dataclass inside ModelConfig) lists as model.lora.rank etc."""
    docs = describe_keys(root=_Outer)
    assert [(d.key, d.type, d.default, d.doc) for d in docs] == [
        ("path", "str", "m", "Model path."),
        ("lora.rank", "int", 8, "Adapter rank."),
        ("lora.modules", "list[str]", ["q_proj"], "Modules to adapt, wrapped over lines."),
        ("undocumented", "int", 0, ""),
    ]
    assert [d.key for d in describe_keys("lora", root=_Outer)] == ["lora.rank", "lora.modules"]
    assert field_docs(_Outer) == {"path": "Model path.", "lora": "The adapter."}


def test_section_filter_and_unknown_section():
    keys = [d.key for d in describe_keys("update")]
    assert keys[0] == "update.lr" and all(k.startswith("update.") for k in keys)
    assert [d.key for d in describe_keys("seed")] == ["seed"]
    with pytest.raises(ConfigError, match="did you mean 'update'"):
        describe_keys("updat")


def test_config_keys_text_json_markdown(capsys):
    assert main(["config", "keys", "update"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(describe_keys("update"))
    assert lines[0].split() == ["update.lr", "float", "=", "0.001", "Peak", "learning", "rate", "(AdamW)."]

    assert main(["config", "keys", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(describe_keys())
    assert {"key": "rollout.group_size", "type": "int", "default": 8, "doc": "G: completions per prompt."} in rows

    assert main(["config", "keys", "rollout", "--format", "markdown"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[:2] == ["| key | type | default | description |", "|---|---|---|---|"]
    assert "| `rollout.backend` | `'hf' \\| 'vllm'` | `\"hf\"` |" in table[2]
    assert len(table) == 2 + len(describe_keys("rollout"))


def test_config_keys_unknown_section_is_one_line(capsys):
    assert main(["config", "keys", "rolout"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("forgeweave: error: no config section or key 'rolout'; did you mean 'rollout'")
    assert "\n" not in err


# ---------------------------------------------------------------- config show and the overlay


def _yaml(tmp_path: Path, text: str, name: str = "over.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_config_show_prints_the_resolved_config_a_run_saves(tmp_path, capsys):
    over = _yaml(tmp_path, "steps: 7\nupdate:\n  lr: 5.0e-4\n")
    args = ["--preset", "smollm2-arith", "--config", over, "--set", "eval.k=2"]
    assert main(["config", "show", *args]) == 0
    out = capsys.readouterr().out
    assert out == dump_yaml(resolve_config("smollm2-arith", over, ["eval.k=2"]))
    cfg = load_yaml(_yaml(tmp_path, out, "shown.yaml"))  # valid as --config, and what it says
    assert (cfg.preset, cfg.steps, cfg.update.lr, cfg.eval.k) == ("smollm2-arith", 7, 5e-4, 2)
    assert cfg.model.path == "smollm2-135m-instruct" and cfg.update.warmup_steps == 2  # the rest: the preset's


def test_config_show_validates(capsys):
    assert main(["config", "show", "--set", "rollout.group_size=1"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


def test_overlay_precedence_preset_then_yaml_then_set(tmp_path):
    """preset < YAML (only its keys, section by section) < --set."""
    over = _yaml(tmp_path, "steps: 11\nrollout:\n  group_size: 4\nupdate:\n  lr: 2.0e-4\n")
    cfg = resolve_config("smollm2-arith", over, ["update.lr=3e-4"])
    base = get_preset("smollm2-arith")
    assert cfg.steps == 11 and cfg.rollout.group_size == 4  # from the YAML
    assert cfg.update.lr == 3e-4  # --set beats the YAML
    assert cfg.rollout.temperature == base.rollout.temperature == 0.7  # same section, not in the YAML: preset's
    assert cfg.rollout.max_new_tokens == 12 and cfg.update.warmup_steps == 2 and cfg.update.autocast_bf16
    assert cfg.preset == "smollm2-arith"
    changed = config_diff(base, cfg)
    assert changed == {"steps": [20, 11], "rollout.group_size": [8, 4], "update.lr": [1e-5, 3e-4]}


def test_yaml_may_name_its_base_preset(tmp_path):
    over = _yaml(tmp_path, "preset: tiny-code\nsteps: 5\n")
    cfg = compose(None, over)
    assert cfg.preset == "tiny-code" and cfg.steps == 5
    assert cfg.reward.verifiers == ["code_exec"] and cfg.rollout.group_size == 32  # tiny-code's
    assert compose("tiny-code", over).steps == 5  # naming the same preset twice is fine


def test_yaml_without_preset_and_no_preset_starts_from_defaults(tmp_path):
    cfg = compose(None, _yaml(tmp_path, "steps: 5\n"))
    assert cfg.preset == "" and cfg.steps == 5 and cfg.model.path == RunConfig().model.path
    assert compose(None, None).preset == "tiny"  # neither: tiny, as before


def test_yaml_naming_another_preset_than_preset_flag_is_refused(tmp_path):
    over = _yaml(tmp_path, "preset: tiny\nsteps: 5\n")
    with pytest.raises(ConfigError, match=r"based on preset 'tiny' .* but --preset smollm2-arith"):
        compose("smollm2-arith", over)
    with pytest.raises(ConfigError, match=r"`preset: tinyy` is not a preset"):
        compose(None, _yaml(tmp_path, "preset: tinyy\n", "bad.yaml"))


def test_full_config_yaml_is_the_same_config_on_any_base(tmp_path):
    """A run's config.yaml sets every key: overlaid on any preset it gives back exactly that config."""
    saved = get_preset("tiny-unlabeled")
    saved.steps = 9
    path = _yaml(tmp_path, dump_yaml(saved), "config.yaml")
    for name in PRESETS:
        if name != "tiny-unlabeled":
            with pytest.raises(ConfigError, match="drop one"):
                compose(name, path)
    assert config_diff(saved, compose(None, path)) == {}
    assert config_diff(saved, load_yaml(path)) == {}


def test_overlay_errors_name_the_file_and_key(tmp_path):
    over = _yaml(tmp_path, "update:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"over\.yaml: unknown config key 'update\.lrr'; did you mean 'update\.lr'"):
        compose("tiny", over)


def test_run_and_plan_accept_preset_and_config_together(tmp_path, capsys):
    over = _yaml(tmp_path, "rollout:\n  prompts_per_step: 2\n")
    assert main(["plan", "--preset", "tiny", "--config", over]) == 0
    assert "update" in capsys.readouterr().out
    help_text = _help(["run", "--help"], capsys)
    assert "preset < --config < --set" in " ".join(help_text.split())


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


# ---------------------------------------------------------------- resume: which keys may change


def test_config_diff_lists_changed_leaves_only():
    a, b = RunConfig(), RunConfig()
    b.update.lr, b.steps, b.data.operations = 0.5, 99, ["+", "-"]
    assert config_diff(a, b) == {"steps": [30, 99], "data.operations": [["+"], ["+", "-"]], "update.lr": [1e-3, 0.5]}
    assert config_diff(a, RunConfig()) == {}


@pytest.mark.parametrize(
    "key, old, new",
    [
        ("seed", 0, 1),
        ("model.path", "tiny-random", "other"),
        ("model.tiny.hidden", 64, 128),
        ("model.lora.rank", 8, 16),  # a nested key of a fixed section
        ("data.digits", 1, 2),
        ("reward.verifiers", ["math_answer"], ["format_integer"]),
        ("reward.ensemble.classes", 3, 4),
    ],
)
def test_resume_refuses_keys_the_checkpoint_depends_on(key, old, new):
    with pytest.raises(ConfigError, match=rf"config key '{key}' cannot change on --resume"):
        check_resume_changes({"update.lr": [1e-3, 5e-4], key: [old, new]}, step=10, steps=20)


@pytest.mark.parametrize(
    "key, old, new",
    [
        ("steps", 20, 40),
        ("update.lr", 1e-3, 5e-4),
        ("update.adam_betas", [0.9, 0.99], [0.9, 0.95]),
        ("rollout.group_size", 8, 16),
        ("rollout.temperature", 1.0, 0.7),
        ("update.num_processes", 1, 2),
        ("eval.every", 10, 5),
        ("checkpoint.keep_last", 2, 3),
        ("tracking.tensorboard", False, True),
        ("reward.weights", [], [1.0]),
        ("distill.weight", 1.0, 0.5),
        ("model.gradient_checkpointing", False, True),
    ],
)
def test_resume_allows_keys_that_change_only_how_the_run_goes_on(key, old, new):
    check_resume_changes({key: [old, new]}, step=10, steps=40)


def test_resume_refuses_steps_below_the_checkpoint():
    with pytest.raises(ConfigError, match=r"config key 'steps' is 5, below the checkpoint's step 10"):
        check_resume_changes({"steps": [20, 5]}, step=10, steps=5)
    check_resume_changes({"steps": [20, 10]}, step=10, steps=10)


def test_every_fixed_resume_key_exists():
    keys = [d.key for d in describe_keys()]
    for fixed in RESUME_FIXED:
        assert any(k == fixed or (fixed.endswith(".") and k.startswith(fixed)) for k in keys), fixed


def test_resume_refuses_preset_or_config(tmp_path):
    with pytest.raises(UserError, match="--resume continues the run's own config.yaml"):
        resolve_run("tiny", None, [], "r", str(tmp_path), resume=True)
