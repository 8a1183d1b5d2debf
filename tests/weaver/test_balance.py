import json

import pytest

from weaver.balance import ThroughputBalancer

TOKENS_PER_PROMPT = 32


def makespan(sizes: list[int], speeds: list[float]) -> float:
    return max(n * TOKENS_PER_PROMPT / s for n, s in zip(sizes, speeds, strict=True))


def test_unequal_replicas_finish_within_15_percent_of_the_ideal():
    true_speeds = [100.0, 200.0, 400.0]  # tokens/s: 1x, 2x, 4x
    noise = [1.1, 0.9, 1.05, 0.95, 1.0]  # deterministic jitter on every measurement
    n = 64
    ideal = n * TOKENS_PER_PROMPT / sum(true_speeds)  # 64 * 32 / 700 = 2.93 s
    b = ThroughputBalancer(3)
    first = b.split(n)
    assert first == [22, 21, 21]  # equal to start: 21.33 each, the leftover 1 to replica 0
    assert makespan(first, true_speeds) > 2 * ideal  # 22 * 32 / 100 = 7.04 s: the slow replica stalls the step
    for step in range(5):
        for i, size in enumerate(b.split(n)):
            speed = true_speeds[i] * noise[(step + i) % len(noise)]
            if size:
                b.observe(i, size * TOKENS_PER_PROMPT, size * TOKENS_PER_PROMPT / speed)
        sizes = b.split(n)
    assert sum(sizes) == n
    assert makespan(sizes, true_speeds) <= 1.15 * ideal, (sizes, b.speeds)


def test_exact_speeds_give_the_proportional_split():
    b = ThroughputBalancer(3)
    for i, speed in enumerate([1.0, 2.0, 4.0]):
        b.observe(i, int(speed * 10), 10.0)
    assert b.split(7) == [1, 2, 4]
    # 64 * (1, 2, 4) / 7 = 9.14, 18.29, 36.57 -> floors 9, 18, 36; leftover 1 to the largest remainder (.57)
    assert b.split(64) == [9, 18, 37]
    assert b.split(0) == [0, 0, 0]
    for n in range(20):
        assert sum(b.split(n)) == n and min(b.split(n)) >= 0


def test_moving_average_and_unmeasured_replicas():
    b = ThroughputBalancer(3, alpha=0.5)
    b.observe(0, 100, 1.0)  # first report replaces the guess
    assert b.speeds == [100.0, 100.0, 100.0]  # unmeasured ones are assumed as fast as the mean
    b.observe(0, 300, 1.0)  # 0.5 * 300 + 0.5 * 100
    b.observe(1, 50, 1.0)
    assert b.speeds == [200.0, 50.0, 125.0]


def test_a_stalled_replica_gets_nothing():
    b = ThroughputBalancer(2)
    b.observe(0, 0, 1.0)
    b.observe(1, 100, 1.0)
    assert b.split(10) == [0, 10]


def test_state_dict_round_trip_through_json():
    b = ThroughputBalancer(3, alpha=0.2)
    b.observe(2, 400, 2.0)
    c = ThroughputBalancer(3)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert (c.alpha, c.speeds, c.split(10)) == (0.2, b.speeds, b.split(10))
    with pytest.raises(ValueError, match="state has 3 replicas, this balancer 2"):
        ThroughputBalancer(2).load_state_dict(b.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError):
        ThroughputBalancer(0)
    b = ThroughputBalancer(2)
    for args in ((2, 10, 1.0), (0, -1, 1.0), (0, 10, 0.0)):
        with pytest.raises(ValueError, match="^observe: need"):
            b.observe(*args)
    with pytest.raises(ValueError):
        b.split(-1)
