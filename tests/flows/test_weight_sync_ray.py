"""Ray mode moves weights through the weight group, not the object store: during a run no object larger than 1 MB
is in Ray's object store, asserted from Ray's own state API (`ray.util.state.list_objects`, which needs the
dashboard: this module starts a private Ray instance with it, on 127.0.0.1). The same run with the object-store path
(`RayStages.group = False`) is the control: there the check sees rank 0's weights (the tiny preset's fp32 model is
~2 MB) — so the assertion can fail."""

from __future__ import annotations

import copy

import pytest
import ray
from ray.util.state import list_objects

from flows.planning import plan_run
from flows.ray_exec import RayStages
from forge.presets import tiny
from forge.recipes.grpo import run as grpo_run
from tests.flows.test_ray_exec import POOLS

pytestmark = pytest.mark.slow
MB = 1 << 20


@pytest.fixture(scope="module")
def local_ray():
    resources = {f"pool:{p['name']}": 1000 for p in POOLS}
    ray.init(address="local", num_cpus=2, resources=resources, include_dashboard=True, dashboard_host="127.0.0.1",
             _node_ip_address="127.0.0.1", log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()


def _largest_object() -> int:
    return max((o.object_size or 0 for o in list_objects(limit=10_000, raise_on_missing_output=False)), default=0)


class Watched(RayStages):
    """RayStages that looks at the object store whenever the driver waits on its actors (weights in flight, if
    any, are referenced then), keeping the largest object seen."""

    largest = 0

    def _get(self, refs, stage, timeout=None):
        Watched.largest = max(Watched.largest, _largest_object())
        return super()._get(refs, stage, timeout)


class WatchedObjectStore(Watched):
    group = False


def _run(stages, tmp_path) -> int:
    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.checkpoint.every = 2, 100, 100
    cfg.orchestration.execution, cfg.tracking.mlflow, cfg.pools = "ray", False, copy.deepcopy(POOLS)
    Watched.largest = 0
    _, plan = plan_run(cfg)
    summary = grpo_run(cfg, tmp_path, progress=False, plan=plan, stages=stages, execution="ray")
    assert summary["steps"] == 2
    return Watched.largest


def test_no_object_over_1mb_in_the_object_store_during_a_ray_run(local_ray, tmp_path):
    assert _run(Watched, tmp_path / "group") <= MB


def test_the_object_store_path_would_fail_the_check(local_ray, tmp_path):
    assert _run(WatchedObjectStore, tmp_path / "store") > MB
