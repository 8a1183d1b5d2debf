"""The recipe's docstring is the reader's map of where forgeweave departs from textbook GRPO: every config key it
names must exist, and every default it states (`key` = value) must be the real default."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

import forge.recipes.grpo as grpo
from forge.config import RunConfig, describe_keys

SECTIONS = {d.key.split(".")[0] for d in describe_keys() if "." in d.key}
KEY = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)`(?: = ([^\s,;:)]+))?")


def named_keys(text: str) -> list[tuple[str, str | None]]:
    """(key, stated default or None) for every backticked dotted name whose first part is a config section."""
    return [(k, d) for k, d in KEY.findall(text) if k.split(".")[0] in SECTIONS]


def test_the_pattern_finds_keys_and_defaults_and_skips_module_names():
    text = "uses `algo.beta` = 0.0 and `update.adaptive`, see `forge.losses.MAX_LOG_RATIO`"
    assert [(k, d or None) for k, d in named_keys(text)] == [("algo.beta", "0.0"), ("update.adaptive", None)]


def test_every_key_the_recipe_docstring_names_exists_with_the_default_it_states():
    keys = {d.key: d.default for d in describe_keys()}
    sections = {d.key.rsplit(".", 1)[0] for d in describe_keys()}  # a section may be named as a whole
    found = named_keys(grpo.__doc__)
    assert len(found) >= 10  # the departures are listed with their keys
    for key, stated in found:
        assert key in keys or key in sections, f"the recipe's docstring names `{key}`, which is no config key"
        if stated:
            assert key in keys, f"`{key}` is a section; a default belongs to a key"
            value = yaml.safe_load(stated.rstrip("."))
            assert value == keys[key], f"the docstring says `{key}` = {stated}, the default is {keys[key]!r}"
    assert RunConfig().algo.loss == "grpo"  # and grpo is the paper's sequence mean (forge.losses.sequence_mean)
    assert grpo.LOSSES["grpo"][1].__name__ == "sequence_mean"


def test_the_recipe_stays_readable_and_no_forge_function_grows_past_60_lines():
    """Issue 29's shape: grpo.py, update math included, fits in 300 lines; no function in forge is over 60 lines
    (a long function is where a loop's bookkeeping or a second algorithm hides)."""
    forge = Path(__file__).resolve().parents[2] / "forge"
    assert len((forge / "recipes" / "grpo.py").read_text().splitlines()) <= 300
    long = [
        f"{path.relative_to(forge.parent)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(forge.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []
