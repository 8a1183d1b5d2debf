"""docs/trl.md names only config keys that exist (its GRPOConfig table's forgeweave column), and docs/config.md's
example error is the one a run gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forge.config import ConfigError, describe_keys
from forge.resume import check_resume_changes

DOCS = Path(__file__).resolve().parents[1] / "docs"


def table_keys(text: str, heading: str) -> list[str]:
    """Backticked names in the second column of the table under `heading` (a `key=value` counts as its key)."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| TRL")]
    cells = [row.split(" | ")[1] for row in rows if not set(row) <= {"|", "-", " "}]
    return [name.split("=")[0] for cell in cells for name in re.findall(r"`([^`]+)`", cell)]


def test_every_forgeweave_key_in_the_trl_table_exists():
    keys = {d.key for d in describe_keys()}
    named = table_keys((DOCS / "trl.md").read_text(), "## GRPOConfig → forgeweave")
    assert len(named) > 60
    unknown = sorted({k for k in named if k not in keys})
    assert not unknown, f"docs/trl.md names keys forge/config.py does not have: {unknown}"


def test_docs_config_example_error_is_the_real_one():
    text = (DOCS / "config.md").read_text()
    shown = re.search(r"forgeweave: error: (config key 'seed' cannot change on --resume.*)", text).group(1)
    with pytest.raises(ConfigError) as e:
        check_resume_changes({"seed": [0, 1]}, step=10, steps=20)
    assert str(e.value) == shown
