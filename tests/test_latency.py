"""RttEstimator: adaptive reply timeouts from measured round trips; Stragglers: when one lookup
stops waiting for its slowest queries (sans-IO)."""

from __future__ import annotations

import pytest

from dht.latency import RttEstimator, Stragglers


def test_timeouts_follow_measurements_within_floor_and_ceiling():
    est = RttEstimator(floor=0.05, ceiling=2.0)
    assert est.timeout("a") == 2.0  # nothing measured yet: the RPC timeout
    for _ in range(20):
        est.observe("a", 0.001)
        est.observe("slow", 0.2)
    assert est.timeout("a") == 0.05  # 1 ms round trips: the floor
    assert 0.2 <= est.timeout("slow") < 0.3  # steady 200 ms: srtt plus a small variation
    assert est.timeout("a") < est.timeout("new") < 2.0  # never measured: the node-wide estimate
    est.observe("a", 30.0)
    assert est.timeout("a") == 2.0  # the ceiling


def test_a_timeout_doubles_until_the_next_reply():
    est = RttEstimator(floor=0.01, ceiling=5.0)
    for _ in range(20):
        est.observe("p", 0.1)
    base = est.timeout("p")
    est.timed_out("p")
    est.timed_out("p")
    assert est.timeout("p") == pytest.approx(4 * base)
    est.observe("p", 0.1)
    assert est.timeout("p") == pytest.approx(base, rel=0.1)
    est.timed_out("unknown")  # a peer never measured keeps the node-wide estimate
    assert est.timeout("unknown") == pytest.approx(est.timeout("p"), rel=0.5)


def test_remembers_at_most_max_peers():
    est = RttEstimator(floor=0.01, ceiling=5.0, max_peers=2)
    est.observe("a", 1.0)
    assert est.timeout("a") > 1.0
    for _ in range(20):
        est.observe("b", 0.01)
        est.observe("c", 0.01)
    assert est.timeout("a") < 0.1  # forgotten: the node-wide estimate, not its own


def test_rejects_a_floor_above_the_ceiling():
    with pytest.raises(ValueError):
        RttEstimator(floor=3.0, ceiling=2.0)


def test_a_straggler_is_a_query_far_slower_than_the_fastest_quarter_once_a_quorum_answered():
    local = Stragglers(k=8)
    local.answered(0.0005)
    for seconds in (0.0004, 0.0006):
        local.answered(seconds)
    assert local.cutoff() is None  # a lookup waits for half of k
    local.answered(0.030)  # one peer's process was waiting for a CPU
    assert local.cutoff() == pytest.approx(0.0005 + 0.005)  # sub-millisecond: the slack
    wide = Stragglers(k=8)
    for seconds in (0.08, 0.1, 0.12, 0.15, 0.2, 0.9, 1.5, 1.6):
        wide.answered(seconds)
    assert wide.cutoff() == pytest.approx(3 * 0.12)  # three times the fastest quarter's
