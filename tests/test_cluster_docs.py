"""The cluster examples work as written: the run configs in docs/ray.md and README.md plan as the text says (the
table docs/ray.md shows is the one `forgeweave plan` prints), the `ray start` lines beside them offer exactly the
pools those configs declare, each node only pools of its own host, and docker/compose.yaml's Ray nodes offer the
pools that a run started there autodetects."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from flows.planning import plan_run
from flows.runs import resolve_config
from weaver.apply import driver_env
from weaver.discover import Gpu, Resources
from weaver.plan import Plan
from weaver.pools import autodetect_pools

REPO = Path(__file__).resolve().parents[1]


def section(path: Path, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level (outside code blocks, where a
    line starting with `# ` is a shell comment)."""
    level = len(heading.split(" ")[0])
    lines, fenced = [], False
    for line in path.read_text().split(f"\n{heading}\n", 1)[1].splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        lines.append(line)
    return "\n".join(lines) + "\n"


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def offered(bash: str) -> list[set[str]]:
    """The pools each `ray start` line of a shell block offers (`--resources '{"pool:<name>": n, ...}'`)."""
    nodes = []
    for line in bash.splitlines():
        if line.startswith("ray start"):
            words = shlex.split(line.split("#")[0])
            resources = json.loads(words[words.index("--resources") + 1])
            nodes.append({k.removeprefix("pool:") for k in resources if k.startswith("pool:")})
    return nodes


def planned(tmp_path: Path, config: str) -> tuple[Plan, dict[str, dict]]:
    """The plan `forgeweave plan --config` makes of `config` (YAML text), and its pools by name."""
    path = tmp_path / "run.yaml"
    path.write_text(config)
    plan, _ = plan_run(resolve_config(None, str(path), []))
    return plan, {p["name"]: p for p in yaml.safe_load(config)["pools"]}


def check_nodes(nodes: list[set[str]], pools: dict[str, dict], plan: Plan) -> None:
    """Every pool is offered, nothing else is, a node offers one host's pools, and every stage lands on one."""
    assert set().union(*nodes) == set(pools), (nodes, sorted(pools))
    assert all(len({pools[name]["host"] for name in node}) == 1 for node in nodes), nodes
    for stage in ("rollout", "reward", "update"):
        assert set(plan.for_stage(stage).pools) <= set().union(*nodes), stage


def test_ray_md_cluster_example_plans_as_shown_on_the_nodes_it_starts(tmp_path):
    text = section(REPO / "docs" / "ray.md", "## On a cluster")
    (config, *_), (table, *_), (bash, *_) = blocks(text, "yaml"), blocks(text, "text"), blocks(text, "bash")
    plan, pools = planned(tmp_path, config)
    assert plan.table() == table.strip()  # the table the page shows is the one `forgeweave plan` prints
    assert plan.for_stage("rollout").pools == ("gen",) and plan.for_stage("update").pools == ("train-a", "train-b")
    assert plan.for_stage("reward").pools == ("cpu",)
    nodes = offered(bash)
    assert len(nodes) == 3
    check_nodes(nodes, pools, plan)


def test_ray_md_network_example_sets_what_the_driver_passes_on():
    text = section(REPO / "docs" / "ray.md", "### Network interfaces: NCCL and gloo")
    (bash,) = blocks(text, "bash")
    exported = dict(w.split("=", 1) for w in shlex.split(re.search(r"^export (.*)$", bash, re.M)[1]))
    assert set(exported) >= {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}
    assert driver_env(exported) == exported  # every variable the example exports reaches the actors
    head = section(REPO / "docs" / "ray.md", "## On a cluster")
    assert offered(bash) == offered(blocks(head, "bash")[0])[:1]  # the same head node as the cluster example


def test_readme_cluster_example_plans_the_stages_on_the_pools_it_names(tmp_path):
    text = section(REPO / "README.md", "## Scaling out: Ray actors placed by Weaver")
    (bash,) = [b for b in blocks(text, "bash") if "ray start" in b]
    (config,) = blocks(text, "yaml")
    plan, pools = planned(tmp_path, config)
    assert plan.for_stage("rollout").pools == ("gen",) and plan.for_stage("update").pools == ("train",)
    check_nodes(offered(bash), pools, plan)


def test_compose_ray_nodes_offer_the_pools_a_run_there_autodetects():
    services = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]
    box = Resources("worker", 8, 32.0, [Gpu(0, "H200", 141.0)])
    names = {p.name for p in autodetect_pools(box)}  # a run without `pools:` plans on these
    for service, pool in (("worker", "cpu"), ("worker-gpu", "gpu")):
        (node,) = offered(services[service]["command"][2].replace("--resources=", "--resources "))
        assert node == {pool} and pool in names, service
