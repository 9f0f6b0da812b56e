"""Routing table and lookup, tested by simulating whole networks in memory (no sockets)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.identity import Identity, PeerID
from dht.routing import (
    ID_BITS,
    Contact,
    Lookup,
    RoutingTable,
    distance,
    key_id,
    node_id_of,
)

_PEERS = [Identity().peer_id for _ in range(600)]  # key generation is the slow part: share them


def contact(peer: PeerID, port: int = 1) -> Contact:
    return Contact(peer, ("10.0.0.1", port))


def peers_in_bucket(table: RoutingTable, index: int, count: int) -> list[PeerID]:
    found = [p for p in _PEERS if table.bucket_index(node_id_of(p)) == index]
    assert len(found) >= count
    return found[:count]


def test_ids_and_distance():
    peer = _PEERS[0]
    assert 0 <= node_id_of(peer) < 2**ID_BITS
    assert node_id_of(peer) == Contact(peer, None).node_id
    assert key_id(b"a") != key_id(b"b")
    assert distance(5, 3) == 6 and distance(7, 7) == 0


def test_bucket_index():
    table = RoutingTable(own_id=0)
    assert table.bucket_index(1 << (ID_BITS - 1)) == 0
    assert table.bucket_index(1) == ID_BITS - 1
    assert table.bucket_index(0) == ID_BITS
    own = node_id_of(_PEERS[0])
    table = RoutingTable(own_id=own)
    table.update(Contact(_PEERS[0], ("h", 1)), now=0)
    assert len(table) == 0  # our own id is never stored


def test_client_mode_contacts_are_not_routable():
    table = RoutingTable(own_id=0)
    assert table.update(Contact(_PEERS[1], None), now=0) is None
    assert _PEERS[1] not in table


def test_update_refreshes_known_contact():
    table = RoutingTable(own_id=node_id_of(_PEERS[0]), k=2)
    a, b = peers_in_bucket(table, 0, 2)
    table.update(contact(a), now=1)
    table.update(contact(b), now=2)
    table.get(a).failures = 1  # type: ignore[union-attr]
    table.update(contact(a, port=9), now=3)
    known = table.get(a)
    assert known is not None and known.addr == ("10.0.0.1", 9)
    assert known.last_seen == 3 and known.failures == 0
    assert [c.peer_id for c in table.buckets[0].contacts.values()] == [b, a]


def test_full_bucket_returns_lrs_and_promotes_replacement_on_remove():
    table = RoutingTable(own_id=node_id_of(_PEERS[0]), k=3)
    p = peers_in_bucket(table, 0, 5)
    for i in range(3):
        assert table.update(contact(p[i]), now=i) is None
    assert table.update(contact(p[3]), now=59) is None  # the oldest answered within ping_after
    lrs = table.update(contact(p[3]), now=60)
    assert lrs is not None and lrs.peer_id == p[0]
    assert p[3] not in table
    assert table.update(contact(p[4]), now=61).peer_id == p[0]  # type: ignore[union-attr]
    table.remove(p[0])  # the ping failed
    assert p[0] not in table and p[4] in table and p[3] not in table  # newest replacement wins
    assert len(table) == 3
    table.remove(p[1])
    assert p[3] in table


def test_mark_failed_evicts_after_max_failures():
    table = RoutingTable(own_id=node_id_of(_PEERS[0]), k=2, max_failures=2)
    p = peers_in_bucket(table, 0, 3)
    table.update(contact(p[0]), now=0)
    table.update(contact(p[1]), now=0)
    table.update(contact(p[2]), now=1)  # cached as a replacement
    assert table.mark_failed(p[0]) is False
    assert p[0] in table
    assert table.mark_failed(p[0]) is True
    assert p[0] not in table and p[2] in table
    assert table.mark_failed(_PEERS[-1]) is False  # unknown peer


def test_iteration_and_len():
    table = RoutingTable(own_id=node_id_of(_PEERS[0]))
    for peer in _PEERS[1:51]:
        table.update(contact(peer), now=0)
    assert len(table) == len(list(table)) == sum(1 for p in _PEERS[1:51] if p in table)
    assert all(table.get(c.peer_id) is c for c in table)


@settings(max_examples=50, deadline=None)
@given(
    own=st.integers(0, 2**ID_BITS - 1),
    target=st.integers(0, 2**ID_BITS - 1),
    count=st.integers(0, 40),
    n=st.integers(0, 120),
    near=st.integers(0, 8),
)
def test_closest_matches_brute_force(own, target, count, n, near):
    target = own ^ (target >> near)  # near > 0: a target sharing a prefix with us, as our own lookups
    table = RoutingTable(own_id=own, k=8)
    for peer in _PEERS[:n]:
        table.update(contact(peer), now=0)
    exclude = {c.peer_id for c in list(table)[:3]}
    expected = sorted(
        (c for c in table if c.peer_id not in exclude), key=lambda c: c.node_id ^ target
    )[:count]
    assert table.closest(target, count, exclude=exclude) == expected


def _table_of(sizes: dict[int, int], now: float = 0) -> RoutingTable:
    """A k=4 table holding ``sizes[i]`` contacts in bucket i."""
    table = RoutingTable(own_id=node_id_of(_PEERS[0]), k=4)
    for index, count in sizes.items():
        for peer in peers_in_bucket(table, index, count):
            table.update(contact(peer), now=now)
    return table


def test_refresh_targets_land_in_stale_buckets_that_are_not_full():
    rng = random.Random(1)
    table = _table_of({0: 4, 1: 4, 2: 2, 4: 1}, now=3650)  # hearing from peers is no lookup
    targets = table.buckets_to_refresh(now=3700, interval=3600, rng=rng)
    assert [table.bucket_index(t) for t in targets] == [2, 3, 4]  # not full, up to the deepest
    for target in targets:
        table.touch(target, now=3700)
    assert table.buckets_to_refresh(now=7299, interval=3600, rng=rng) == []
    for index in (3, 4):  # looked up again since
        table.buckets[index].last_touched = 7000
    targets = table.buckets_to_refresh(now=7300, interval=3600, rng=rng)
    assert [table.bucket_index(t) for t in targets] == [2]
    assert RoutingTable(own_id=1).buckets_to_refresh(0, 1, rng) == []


def test_a_lookup_counts_for_every_bucket_its_k_closest_cover():
    table = _table_of({0: 4, 1: 4, 2: 4, 3: 2, 5: 1})
    found = table.closest(table.own_id, 4)  # a lookup of ourselves, as a join does
    assert [table.bucket_index(c.node_id) for c in found] == [5, 3, 3, 2]
    table.touch(table.own_id, now=100, found=found)
    # every id in buckets 3 to 5 is nearer us than the farthest found: they were seen whole
    assert [i for i, b in enumerate(table.buckets) if b.last_touched == 100] == [3, 4, 5]
    target = found[-1].node_id ^ 1
    table.touch(target, now=200, found=table.closest(target, 3))  # fewer than k found: its own bucket only
    assert [i for i, b in enumerate(table.buckets) if b.last_touched == 200] == [2]


class Network:
    """N nodes, each with a routing table filled as if it had heard from every other node."""

    def __init__(self, n: int, k: int, seed: int):
        self.rng = random.Random(seed)
        self.k = k
        self.peers = _PEERS[:n]
        self.tables = {p: RoutingTable(node_id_of(p), k=k) for p in self.peers}
        for peer, table in self.tables.items():
            others = [q for q in self.peers if q != peer]
            self.rng.shuffle(others)
            for other in others:
                table.update(contact(other), now=0)
        self.dead: set[PeerID] = set()

    def lookup(self, origin: PeerID, target: int, alpha: int = 3) -> Lookup:
        table = self.tables[origin]
        lookup = Lookup(target, table.closest(target, self.k), k=self.k, alpha=alpha, own_peer=origin)
        in_flight: list[Contact] = []
        while not lookup.finished:
            in_flight.extend(lookup.next_queries())
            assert in_flight, "an unfinished lookup must have something to wait for"
            # answers arrive in arbitrary order
            queried = in_flight.pop(self.rng.randrange(len(in_flight)))
            if queried.peer_id in self.dead:
                lookup.on_failure(queried)
            else:
                found = self.tables[queried.peer_id].closest(target, self.k)
                lookup.on_response(queried, found)
        return lookup

    def true_closest(self, target: int, origin: PeerID) -> list[PeerID]:
        live = [p for p in self.peers if p not in self.dead and p != origin]
        return sorted(live, key=lambda p: node_id_of(p) ^ target)[: self.k]


@pytest.fixture(scope="module")
def network() -> Network:
    return Network(500, k=20, seed=7)


def test_lookup_converges_to_true_closest(network):
    n, k = len(network.peers), network.k
    max_hops = math.ceil(math.log2(n) / math.log2(k)) + 2
    rng = random.Random(3)
    for _ in range(20):
        origin = rng.choice(network.peers)
        target = rng.getrandbits(ID_BITS)
        lookup = network.lookup(origin, target)
        result = lookup.result()
        expected = network.true_closest(target, origin)
        assert [c.peer_id for c in result] == expected
        assert max(lookup.depth(c) for c in result) <= max_hops
        assert lookup.queried < n // 4  # far fewer messages than a flood


def test_lookup_with_failing_nodes(network):
    rng = random.Random(5)
    network.dead = set(rng.sample(network.peers, len(network.peers) // 5))
    try:
        live = [p for p in network.peers if p not in network.dead]
        for _ in range(10):
            origin = rng.choice(live)
            target = rng.getrandbits(ID_BITS)
            result = [c.peer_id for c in network.lookup(origin, target).result()]
            network.dead, dead = set(), network.dead
            overall = network.true_closest(target, origin)
            network.dead = dead
            # Answers still list dead peers (real tables evict them over time) and so can crowd
            # the farthest live ones out; every live peer among the true k closest is found.
            nearest_live = [p for p in overall if p not in dead]
            assert result[: len(nearest_live)] == nearest_live
            assert result == sorted(result, key=lambda p: node_id_of(p) ^ target)
            assert not set(result) & network.dead
    finally:
        network.dead = set()


def test_lookup_bookkeeping():
    peers = _PEERS[:6]
    lookup = Lookup(0, [contact(p) for p in peers[:4]], k=3, alpha=2, own_peer=peers[5])
    first = lookup.next_queries()
    assert len(first) == 2 and lookup.next_queries() == []  # alpha bounds what is in flight
    lookup.on_response(first[0], [contact(peers[5]), contact(peers[0]), Contact(peers[4], None)])
    assert lookup.depth(first[0]) == 1
    with pytest.raises(KeyError):  # own peer, duplicates and client-mode peers are ignored
        lookup.depth(contact(peers[5]))
    with pytest.raises(KeyError):
        lookup.depth(contact(peers[4]))
    lookup.on_failure(first[1])
    assert first[1] not in lookup.result()
    assert not lookup.finished
    lookup.stop()
    assert lookup.finished and lookup.next_queries() == []


def test_lookup_with_no_contacts_is_finished():
    lookup = Lookup(123, [])
    assert lookup.finished and lookup.result() == [] and lookup.next_queries() == []


def test_lookup_asks_the_rest_of_the_window_at_once_after_the_closest_answered():
    """Kademlia's last round: alpha at a time while closer peers turn up, then the rest of the k
    closest in one round trip instead of one per alpha of them."""
    peers = sorted(_PEERS[:12], key=node_id_of)  # target 0: the first is the closest
    lookup = Lookup(0, [contact(p) for p in peers[1:9]], k=8, alpha=2)
    first = lookup.next_queries()
    assert [c.peer_id for c in first] == peers[1:3]
    lookup.on_response(first[0], [contact(peers[0])])  # a closer peer: keep going alpha at a time
    assert [c.peer_id for c in lookup.next_queries()] == [peers[0]]
    lookup.on_response(first[1], [])
    assert [c.peer_id for c in lookup.next_queries()] == [peers[3]]  # peers[0] has not answered yet
    lookup.on_response(contact(peers[0]), [])
    assert [c.peer_id for c in lookup.next_queries()] == peers[4:8]  # the two closest answered
    wide = Lookup(0, [contact(p) for p in peers[1:9]], k=8, alpha=2, wide=True)
    first = wide.next_queries()  # a latest read: the whole window in its first round
    assert [c.peer_id for c in first] == peers[1:9]
    wide.on_response(first[0], [contact(peers[0])])
    assert [c.peer_id for c in wide.next_queries()] == [peers[0]]  # a closer peer at once, 7 in flight


def test_a_query_past_its_timeout_frees_its_slot_and_its_late_reply_still_counts():
    peers = sorted(_PEERS[:8], key=node_id_of)  # target 0: the first is the closest
    lookup = Lookup(0, [contact(p) for p in peers[:4]], k=3, alpha=1)
    slow = lookup.next_queries()[0]
    assert slow.peer_id == peers[0]
    lookup.on_timeout(slow)
    hedge = lookup.next_queries()
    assert [c.peer_id for c in hedge] == [peers[1]]  # the next contact is asked meanwhile
    lookup.on_response(hedge[0], [])
    lookup.on_response(slow, [contact(peers[7])])  # late, but before the lookup ended
    assert lookup.result()[0].peer_id == peers[0] and lookup.depth(contact(peers[7])) == 2
    late_failure = lookup.next_queries()[0]
    lookup.on_timeout(late_failure)
    lookup.on_failure(late_failure)  # then the RPC itself failed: it stays out
    lookup.on_response(late_failure, [])  # (a reply after a failure is ignored)
    assert late_failure.peer_id not in [c.peer_id for c in lookup.result()]


def test_a_lookup_waits_for_a_late_query_only_while_nothing_answered():
    peers = sorted(_PEERS[:2], key=node_id_of)
    lookup = Lookup(0, [contact(peers[0])], k=3, alpha=1)  # a join: the bootstrap peer alone
    only = lookup.next_queries()[0]
    lookup.on_timeout(only)
    assert not lookup.finished and lookup.next_queries() == []
    lookup.on_response(only, [])
    assert lookup.finished and [c.peer_id for c in lookup.result()] == peers[:1]
    lookup = Lookup(0, [contact(p) for p in peers], k=3, alpha=2)
    first, second = lookup.next_queries()
    lookup.on_response(first, [])
    lookup.on_timeout(second)
    assert lookup.finished  # an answer came: a straggler costs no more than its timeout


def test_a_peer_evicted_for_failing_is_not_taken_from_hearsay_until_heard_from():
    table = RoutingTable(own_id=node_id_of(_PEERS[0]), k=4)
    dead, live = peers_in_bucket(table, 0, 2)
    for peer in (dead, live):
        table.update(contact(peer), now=0)
    table.mark_failed(dead)
    table.mark_failed(dead)
    assert dead not in table
    named = [contact(dead), contact(live)]  # a lookup reply still naming the dead peer
    assert [c.peer_id for c in table.vouched(named)] == [live]
    table.update(contact(dead), now=5)  # it called us: alive after all
    assert [c.peer_id for c in table.vouched(named)] == [dead, live]
