"""The in-process DHT simulation (``dht.sim``): its event loop and network, and a small network
joined, loaded, churned and repaired with the real routing, lookup and storage code."""

from __future__ import annotations

from bisect import bisect_left

import pytest

from dht import DHTConfig
from dht.maintenance import republish_batches
from dht.routing import ID_BITS, key_id
from dht.sim import EventLoop, NetConfig, Simulation, hop_bound
from dht.storage import Record


def test_event_loop_runs_in_time_order_and_stops_at_until():
    loop, seen = EventLoop(start=0.0), []
    loop.call_at(2.0, seen.append, "c")
    loop.call_at(1.0, seen.append, "a")
    loop.call_at(1.0, seen.append, "b")  # a tie runs in scheduling order
    loop.call_at(5.0, seen.append, "late")
    loop.run(until=3.0)
    assert seen == ["a", "b", "c"] and loop.now == 3.0
    loop.call_at(0.5, seen.append, "past")  # the past is due now, never before the clock
    loop.run(done=lambda: "past" in seen)
    assert seen[-1] == "past" and loop.now == 3.0
    loop.run()
    assert seen[-1] == "late" and loop.now == 5.0


def test_hop_bound():
    assert hop_bound(4096, 20) == 5  # ceil(12 / 4.32) + 2
    assert hop_bound(256, 20) == 4


def test_a_call_to_a_dead_peer_fails_after_the_rpc_timeout_and_evicts_it_on_the_second():
    sim = Simulation(DHTConfig(rpc_timeout=2.0), NetConfig(loss=0.0), seed=3)
    a, b, c = sim.add_node(), sim.add_node(), sim.add_node()
    sim.join(a)
    sim.join(b)
    sim.loop.run(done=lambda: b.joined)
    sim.join(c)
    sim.loop.run(done=lambda: c.joined)
    assert b.peer_id in a.routing and a.peer_id in b.routing and c.peer_id in a.routing
    contact = a.routing.get(b.peer_id)
    b.alive = False
    outcomes: list[tuple[float, object]] = []
    for _ in range(2):
        start = sim.loop.now
        sim.call(a, contact, "ping", None, lambda reply, s=start: outcomes.append((sim.loop.now - s, reply)))
        sim.loop.run(done=lambda n=len(outcomes) + 1: len(outcomes) == n)
    assert [round(t, 6) for t, _ in outcomes] == [2.0, 2.0]
    assert all(reply is not None for _, reply in outcomes)  # the failure marker, not ping's None
    assert b.peer_id not in a.routing  # max_failures = 2
    c.alive = False
    for _ in range(3):
        sim.call(a, a.routing.get(c.peer_id), "ping", None, outcomes.append)
        sim.loop.run(done=lambda n=len(outcomes) + 1: len(outcomes) == n)
    assert list(a.routing) == [a.routing.get(c.peer_id)]  # the last contact stays: a can still rejoin


def test_republish_batches_skip_keys_received_lately_and_keep_our_own_writes():
    now = 100.0
    own = Record(b"mine", None, b"v", now + 50)
    stored = [Record(b"got", None, b"v", now + 50), Record(b"fresh", None, b"v", now + 50),
              Record(b"old", None, b"v", now - 1)] + [Record(b"dict", b"%d" % i, b"v", now + 50) for i in range(300)]
    batches = republish_batches({(b"mine", None): own}, stored, {b"fresh"}, now)
    keys = sorted((b[0].key, len(b)) for b in batches)
    assert keys == [(b"dict", 44), (b"dict", 256), (b"got", 1), (b"mine", 1)]
    forced = republish_batches({}, stored, {b"fresh"}, now, force=True)
    assert b"fresh" in {b[0].key for b in forced} and b"old" not in {b[0].key for b in forced}


def test_a_join_whose_lookup_went_unanswered_looks_again():
    # 10% of messages lost: a join lookup whose one contact's reply is lost would leave the table
    # with the bootstrap peer alone; looking again leaves only the rare double loss that thin
    sim = Simulation(net=NetConfig(loss=0.1), seed=0)
    sim.grow(100)
    assert sum(len(n.routing) < sim.config.k // 2 for n in sim.nodes) <= 2  # 8 without the retry


def test_the_first_upkeep_round_after_a_join_fills_the_far_buckets():
    # peers that called us or answered us do not count as a lookup into their bucket: without the
    # refresh, a 1024-node network's far buckets held 12 of 20 and lookups needed an extra hop
    sim = Simulation(net=NetConfig(loss=0.0), seed=1)
    sim.grow(150)
    sim.run_for(sim.config.maintenance_period + 5)
    ids, k, short = sorted(n.node_id for n in sim.nodes), sim.config.k, []
    for node in sim.nodes:
        for index, bucket in enumerate(node.routing.buckets[:3]):
            shift = ID_BITS - 1 - index  # the bucket's range: our first `index` bits, then the other bit
            low = ((node.node_id >> shift) ^ 1) << shift
            exist = bisect_left(ids, low + (1 << shift)) - bisect_left(ids, low)
            if len(bucket.contacts) < min(k, exist) - 2:  # (a range of about k: the lookup may miss one)
                short.append((index, len(bucket.contacts), exist))
    assert short == []  # 337 of 450 before: many a bucket 0 held 1 or 2 contacts of 20


@pytest.fixture(scope="module")
def churned():
    """200 nodes joined, 100 values stored, gets before churn; then 30% killed and 20 joined."""
    sim = Simulation(seed=7)
    sim.grow(200)
    items = sim.store_many(100)
    before = sim.get_many(items, 300)
    sim.kill(0.3)
    sim.grow(20)
    return sim, items, before


def _live_holders(sim: Simulation, key: bytes) -> int:
    return sum(1 for n in sim.live() if n.storage.get(key, sim.loop.now))


def test_values_are_stored_at_the_k_closest_and_found_within_the_hop_bound(churned):
    sim, items, before = churned
    assert before.success == 1.0
    assert max(before.hops) <= hop_bound(200, sim.config.k)
    key = items[0][0]
    closest = sorted((n for n in sim.nodes[:200]), key=lambda n: n.node_id ^ key_id(key))[: sim.config.k]
    assert sum(1 for n in closest if n.storage.get(key, sim.loop.now)) >= sim.config.k - 2


def test_gets_succeed_after_churn_and_republishing_restores_the_replicas(churned):
    sim, items, _ = churned
    after = sim.get_many(items, 300)
    assert after.success >= 0.999
    assert max(after.hops) <= hop_bound(len(sim.live()), sim.config.k)
    thinned = min(_live_holders(sim, key) for key, _ in items)
    assert thinned < sim.config.k  # the kill took replicas away
    # a holder's round skips keys received since its previous one (the first: since it started),
    # so the replicas come back within two rounds, not one
    sim.run_for(sim.config.republish_interval * 2.5)
    assert min(_live_holders(sim, key) for key, _ in items) >= sim.config.k - 2
    assert sim.get_many(items, 300).success == 1.0


def test_a_latest_read_asks_its_whole_window_at_once_and_ends_sooner(churned):
    sim, items, _ = churned
    sim.config.read_quorum = sim.config.k  # a window of the k closest
    try:
        sim.wide_latest = False  # alpha-paced: alpha queries, then the rest of the k closest
        paced = sim.get_many(items, 100, latest=True)
        sim.wide_latest = True
        wide = sim.get_many(items, 100, latest=True)
    finally:
        sim.wide_latest, sim.config.read_quorum = True, None
    assert paced.success == wide.success == 1.0
    assert wide.latency_percentile(0.5) < 0.8 * paced.latency_percentile(0.5)
    quorum = sim.get_many(items, 100, latest=True)  # the nearest half of them
    assert quorum.success == 1.0 and quorum.queried < 0.7 * wide.queried
