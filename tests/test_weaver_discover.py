from weaver import discover


def test_discover_reports_this_machine():
    r = discover()
    assert r.cpu_cores >= 1
    assert r.memory_gib > 0
    assert r.host
    assert all(g.memory_gib > 0 for g in r.gpus)
