"""Losing a whole Ray node mid-run, on a simulated cluster (`ray.cluster_utils.Cluster`, every node on this machine).

The head node offers pool `gen` (rollout, reward, evaluate) and runs the driver; a second node offers pool `train`
(update, one rank). `Cluster.remove_node(node, allow_graceful=False)` kills that node's raylet and every worker on it
at once, as a power loss would. It is removed by the run itself, at the start of a given step's update (a
`RayStages` whose `update` does it first), so where the loss lands does not depend on timing. The GCS is told to
health-check nodes every 100 ms, so a dead node is noticed in about a second instead of Ray's default ~30 s.
The reference is the same run uninterrupted, in this process.
"""

from __future__ import annotations

import copy
import json

import pytest
import ray
from ray.cluster_utils import Cluster

from flows.execute import train
from flows.planning import plan_run
from flows.ray_exec import RayStages
from forge.errors import UserError
from forge.presets import tiny
from forge.recipes.grpo import run as grpo_run
from tests.flows.test_ray_exec import POOLS, assert_close_runs, metrics

pytestmark = pytest.mark.slow
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 100,
                      "health_check_timeout_ms": 200, "health_check_failure_threshold": 3}  # fmt: skip
TRAIN_NODE = {"num_cpus": 2, "resources": {"pool:train": 1000}, "node_ip_address": "127.0.0.1"}
GEN_NODE = {"num_cpus": 1, "resources": {"pool:gen": 1000}, "node_ip_address": "127.0.0.1"}


@pytest.fixture(scope="module")
def cluster():
    """Head (pool gen, the driver) + one train node; the tests may remove and re-add the train node."""
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"pool:gen": 1000}, "include_dashboard": False,
                        "node_ip_address": "127.0.0.1", "_system_config": FAST_HEALTH_CHECKS},
    )  # fmt: skip
    c.add_node(**TRAIN_NODE)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def node_cfg(steps: int = 4):
    cfg = tiny()
    cfg.steps, cfg.eval.every, cfg.checkpoint.every = steps, 2, 2
    cfg.update.num_processes = 1  # one rank: every start is a process fewer (the kill tests cover 2 ranks)
    cfg.orchestration.execution = "ray"
    cfg.tracking.mlflow = False
    cfg.pools = copy.deepcopy(POOLS)
    return cfg


def run(cfg, run_dir, resume: bool = False) -> dict:
    return train(cfg, run_dir, plan_run(cfg)[1], resume=resume, progress=False)


def losing(cluster: Cluster, node, at_step: int):
    """A `RayStages` factory whose workers remove `node` from `cluster` when step `at_step`'s update starts (once),
    after the checkpoint saved in the background before it is durable."""
    before: list[dict] = []  # where the workers were when the node went

    class LosesANode(RayStages):
        def update(self, rollouts, advantages, teacher=None):
            if not before and self.policy_version == at_step - 1:
                self.wait_saved()  # the checkpoint before is durable first: its background save is no race
                before.append(self.where())
                cluster.remove_node(node, allow_graceful=False)
            return super().update(rollouts, advantages, teacher)

    LosesANode.before = before
    return LosesANode


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run uninterrupted, in this process (no actors to start): equal to one rank on Ray to float rounding
    (tests/flows/test_ray_exec.py::test_two_node_run_equals_the_in_process_run)."""
    cfg = node_cfg()
    cfg.orchestration.execution = "embedded"
    d = tmp_path_factory.mktemp("ref") / "uninterrupted"
    assert run(cfg, d)["execution"] == "embedded"
    return d


def test_a_pool_that_lost_its_only_node_stops_with_one_line_and_resumes_exactly_once_it_is_back(
    cluster, reference, tmp_path
):
    """The train node goes at step 3's update (checkpoint at 2): the rebuilt workers would have nowhere to run the
    update, so the run stops naming pool `train`, with what it recorded intact; with a train node back, `--resume`
    redoes step 3 from the checkpoint and ends with the uninterrupted run's numbers."""
    d = tmp_path / "lost"
    (train_node,) = cluster.worker_nodes
    cfg = node_cfg()
    with pytest.raises(UserError) as stop:
        grpo_run(cfg, d, progress=False, plan=plan_run(cfg)[1], stages=losing(cluster, train_node, 3), execution="ray")
    line = str(stop.value)
    assert "\n" not in line and "pool 'train'" in line and "lost its Ray node" in line and "--resume" in line, line
    status = json.loads((d / "status.json").read_text())
    assert status["state"] == "failed" and "pool 'train'" in status["error"]
    assert [m["step"] for m in metrics(d)] == [0, 1, 2]
    assert (d / "checkpoints" / "latest").read_text().strip() == "step-000002"

    with pytest.raises(UserError, match="pool 'train'.*lost its Ray node"):  # still gone: the same line, nothing run
        run(node_cfg(), d, resume=True)
    assert [m["step"] for m in metrics(d)] == [0, 1, 2]

    cluster.add_node(**TRAIN_NODE)
    summary = run(node_cfg(), d, resume=True)
    assert summary["steps"] == 4 and [m["step"] for m in metrics(d)] == [0, 1, 2, 3, 4]
    assert_close_runs(d, reference)


def test_a_pool_with_a_node_left_recovers_on_it_and_finishes(cluster, tmp_path):
    """Two nodes offer pool gen and the 2 rollout replicas are spread over them; the second gen node goes at step 3's
    update: the run rebuilds its workers, both replicas now on the head node (the plan is per pool, so it still
    fits), and goes on from the checkpoint at step 2 by itself."""
    gen_node = cluster.add_node(**GEN_NODE)
    cfg = node_cfg()
    cfg.rollout.replicas, cfg.pools[0]["cpu_cores"] = 2, 2
    stages = losing(cluster, gen_node, 3)
    d = tmp_path / "fewer-nodes"
    summary = grpo_run(cfg, d, progress=False, plan=plan_run(cfg)[1], stages=stages, execution="ray")
    head = ray.get_runtime_context().get_node_id()
    assert {w["node_id"] for w in stages.before[0]["rollout"]} == {head, gen_node.node_id}  # one replica on each
    assert summary["restarts"] == 1 and summary["steps"] == 4
    assert [m["step"] for m in metrics(d)] == [0, 1, 2, 3, 4]
    after = json.loads((d / "workers.json").read_text())
    assert [w["node_id"] for w in after["rollout"]] == [head, head]
