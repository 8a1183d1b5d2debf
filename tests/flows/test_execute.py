"""Where a run's stages go (`flows.execute`): the choice between in-process and Ray actors, and its one-line error."""

from __future__ import annotations

import pytest

from flows.execute import train, use_ray
from forge.compose import local_stages
from forge.errors import UserError
from forge.presets import tiny
from forge.recipes.grpo import update_micro_batch


@pytest.mark.parametrize(
    ("override", "ray"),
    [
        ({}, False),
        ({"algo.max_staleness": 1}, True),  # asynchronous GRPO samples from older weights: a process of its own
        ({"rollout.replicas": 2}, True),
        ({"update.num_processes": 2}, True),
    ],
)
def test_auto_execution_picks_ray_when_the_run_needs_other_processes(override, ray):
    cfg = tiny()
    for key, value in override.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    assert use_ray(cfg, plan=None) is ray


def test_asynchronous_grpo_in_one_process_is_a_one_line_error(tmp_path):
    cfg = tiny()
    cfg.algo.max_staleness, cfg.orchestration.execution = 1, "embedded"
    with pytest.raises(UserError, match="algo.max_staleness>0 need several") as err:
        train(cfg, tmp_path / "run", plan={})
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="algo.max_staleness > 0 needs the rollout in a process of its own"):
        local_stages(cfg, tmp_path / "run", None, update_micro_batch)  # the recipe called directly, without flows.execute
