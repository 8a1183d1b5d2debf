import pytest

from weaver.discover import Gpu, Resources
from weaver.errors import PlanError
from weaver.pools import Pool, autodetect_pools, pools_from_dicts


def test_autodetect_cpu_only_machine():
    pools = autodetect_pools(Resources(host="box", cpu_cores=2, memory_gib=7.5))
    assert pools == [Pool("cpu", "cpu", host="box", cpu_cores=2, memory_gib=7.5)]


def test_autodetect_adds_one_gpu_pool_with_the_smallest_memory():
    res = Resources("box", 16, 128.0, [Gpu(0, "H200", 139.8), Gpu(1, "A100", 79.3)])
    cpu, gpu = autodetect_pools(res)
    assert cpu.kind == "cpu" and cpu.cpu_cores == 16
    assert gpu == Pool("gpu", "gpu", (0, 1), host="box", cpu_cores=16, memory_gib=79.3)


def test_pools_from_dicts_fills_defaults():
    pools = pools_from_dicts(
        [
            {"name": "cpu", "kind": "cpu", "cpu_cores": 8, "memory_gib": 32},
            {"name": "gpu", "kind": "gpu", "devices": [0, 1], "memory_gib": 80, "host": "n1", "work_pool": "gpu-wp"},
        ]
    )
    assert pools[0] == Pool("cpu", "cpu", (), "localhost", "", 8, 32.0)
    assert pools[1] == Pool("gpu", "gpu", (0, 1), "n1", "gpu-wp", 1, 80.0)
    assert pools_from_dicts([p.to_dict() for p in pools]) == pools


def test_same_gpu_index_on_two_hosts_is_fine():
    items = [
        {"name": "a", "kind": "gpu", "devices": [0], "memory_gib": 80, "host": "n1"},
        {"name": "b", "kind": "gpu", "devices": [0], "memory_gib": 80, "host": "n2"},
    ]
    assert [p.host for p in pools_from_dicts(items)] == ["n1", "n2"]


CPU = {"name": "cpu", "kind": "cpu"}


@pytest.mark.parametrize(
    "second, message",
    [
        ({"name": "g", "kind": "gpu", "devices": [0], "memory_gib": 8, "gpus": 2}, "pools[1]: unknown key 'gpus'"),
        ({"name": "g", "kind": "tpu"}, "pools[1].kind: 'tpu' is not a pool kind"),
        ({"name": "cpu", "kind": "cpu"}, "pools[1].name: duplicate pool name 'cpu' (also pools[0])"),
        ({"name": "g", "kind": "gpu", "memory_gib": 80}, "pools[1].devices: gpu pool 'g' lists no devices"),
        ({"name": "g", "kind": "gpu", "devices": [0]}, "pools[1].memory_gib: gpu pool 'g' needs the memory per GPU"),
        ({"name": "c", "kind": "cpu", "devices": [0]}, "pools[1].devices: cpu pool 'c' takes no devices"),
        ({"name": "g", "kind": "gpu", "devices": "0-3", "memory_gib": 8}, "pools[1].devices: expected a list"),
        (
            {"name": "g", "kind": "gpu", "devices": [0, 0], "memory_gib": 8},
            "pools[1].devices: pool 'g' lists a device twice",
        ),
        ({"name": "c", "kind": "cpu", "cpu_cores": 0}, "pools[1].cpu_cores: expected a whole number >= 1"),
        ({"name": "c", "kind": "cpu", "memory_gib": "lots"}, "pools[1].memory_gib: expected a number of GiB"),
        ({"kind": "cpu"}, "pools[1].name: missing"),
        ({"name": "", "kind": "cpu"}, "pools[1].name: expected a non-empty string"),
        ("gpu", "pools[1]: expected a mapping with name and kind, got str"),
    ],
)
def test_pools_from_dicts_errors_name_source_item_and_field(second, message):
    with pytest.raises(PlanError) as e:
        pools_from_dicts([CPU, second], source="pools.yaml")
    assert str(e.value).startswith(f"pools.yaml: {message}")
    assert "\n" not in str(e.value)


def test_one_gpu_in_two_pools_on_the_same_host_is_an_error():
    items = [
        {"name": "a", "kind": "gpu", "devices": [0, 1], "memory_gib": 80},
        {"name": "b", "kind": "gpu", "devices": [1], "memory_gib": 80},
    ]
    with pytest.raises(PlanError, match=r"^pools\[1\]\.devices: GPU 1 on localhost is already in pool 'a'$"):
        pools_from_dicts(items)


def test_empty_or_non_list_pools():
    for bad in ([], {"name": "cpu"}):
        with pytest.raises(PlanError, match="^run.yaml: pools: expected a non-empty list"):
            pools_from_dicts(bad, source="run.yaml")
