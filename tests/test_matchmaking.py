"""Matchmaking: DHT nodes in one event loop forming averaging groups (p2ptrain.averaging)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import pytest
import torch

from dht import Contact, DHTConfig, DHTError, DHTNode, Host, Identity, RPCError
from p2ptrain.averaging.claims import parse_entry
from p2ptrain.averaging.group import Group, Member
from p2ptrain.averaging.join import JOIN_METHOD
from p2ptrain.averaging.matchmaking import Matchmaker
from p2ptrain.averaging.plan import Gathered, gather_verdict, plan_groups, score, settle_window
from p2ptrain.averaging.schema import schema_mismatch_message, tensor_schema

FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=0.5)
PREFIX = "digits-mlp"


def mlp_schema(hidden_in: int = 16, codec: str = "fp16"):
    return tensor_schema(
        [("fc1.weight", torch.zeros(64, hidden_in)), ("fc1.bias", torch.zeros(64)),
         ("fc2.weight", torch.zeros(10, 64))],
        codec,
    )


SCHEMA = mlp_schema()


@pytest.fixture
async def swarm():
    """make(n, listen=...) -> n started nodes, all bootstrapped through the first one."""
    nodes: list[DHTNode] = []
    matchmakers: list[Matchmaker] = []

    async def make(n: int, **kw) -> list[DHTNode]:
        if not nodes:
            first = DHTNode(config=FAST)
            await first.start()
            nodes.append(first)
        new = [DHTNode(config=FAST, **kw) for _ in range(n)]
        await asyncio.gather(*(nd.start(nodes[0].multiaddrs) for nd in new))
        nodes.extend(new)
        return new

    def mm(node: DHTNode, schema=SCHEMA, prefix: str = PREFIX, **kw) -> Matchmaker:
        m = Matchmaker(node, prefix, schema, **kw)
        matchmakers.append(m)
        return m

    try:
        yield make, mm
    finally:
        await asyncio.gather(*(m.close() for m in matchmakers), return_exceptions=True)
        await asyncio.gather(*(nd.close() for nd in nodes), return_exceptions=True)


def assert_consistent(groups: list[Group], peers: list[DHTNode]) -> dict[bytes, Group]:
    """Every peer is in exactly one group, and all members of a group hold the same Group."""
    by_id: dict[bytes, Group] = {}
    for g, node in zip(groups, peers):
        assert node.peer_id in {m.peer_id for m in g.members}
        if g.group_id in by_id:
            assert by_id[g.group_id] == g, "members of one group disagree"
        by_id[g.group_id] = g
    seen = [m.peer_id for g in by_id.values() for m in g.members]
    assert len(seen) == len(set(seen)), "a peer landed in two groups"
    assert set(seen) == {n.peer_id for n in peers}
    return by_id


# ---------------------------------------------------------------------------- sans-IO


def _member(i: int, client: bool = False) -> Member:
    return Member(Identity().peer_id, None if client else ("127.0.0.1", 10000 + i))


def test_plan_is_balanced_and_deterministic():
    members = [_member(i) for i in range(40)]
    plan = plan_groups(members, "k", 16)
    assert sorted(len(g) for g in plan) == [13, 13, 14]
    assert plan == plan_groups(list(reversed(members)), "k", 16)
    assert plan != plan_groups(members, "other round", 16)
    assert sorted(len(g) for g in plan_groups(members[:10], "k", 4)) == [3, 3, 4]
    assert len(plan_groups(members[:16], "k", 16)) == 1


def test_plan_leaders_are_never_client_mode():
    members = [_member(i, client=i % 3 != 0) for i in range(12)]  # 4 servers, 8 clients
    for target in (2, 3, 4, 16):
        plan = plan_groups(members, f"r{target}", target)
        assert plan and all(g[0].addr is not None for g in plan)
        assert max(len(g) for g in plan) - min(len(g) for g in plan) <= 1
    assert plan_groups([_member(0, client=True)], "k", 4) == []


def test_a_gather_stops_when_its_set_settles_or_holds_everyone_and_waits_longer_for_expected_peers():
    g = Gathered(n=3, min_size=2, expected=None, finished=0, last_growth=10.0, settle=0.2, grace=0.9,
                 reserve=0.1, deadline=15.0, joined=False)
    assert gather_verdict(g, 10.1) == ("wait", pytest.approx(10.2))
    assert gather_verdict(g, 10.25) == ("plan", 10.25)
    missing = dataclasses.replace(g, expected=4)
    assert gather_verdict(missing, 10.5) == ("wait", pytest.approx(10.9))  # the grace, not the settle window
    assert gather_verdict(dataclasses.replace(missing, joined=True), 10.5)[0] == "wait"  # a join does not end it
    assert gather_verdict(dataclasses.replace(g, joined=True), 10.05)[0] == "plan"
    assert gather_verdict(dataclasses.replace(missing, n=4), 10.0)[0] == "plan"  # everyone expected is here
    assert gather_verdict(dataclasses.replace(missing, grace=9.0), 14.95)[0] == "plan"  # the deadline's reserve
    alone = dataclasses.replace(g, n=1, expected=3)
    assert gather_verdict(alone, 11.0) == ("wait", 15.0)
    assert gather_verdict(dataclasses.replace(alone, finished=2), 11.0) == ("alone", 11.0)  # they grouped
    assert gather_verdict(alone, 15.0) == ("alone", 15.0)


def test_settle_window_adapts():
    assert settle_window(0.001, [0.0, 0.001], 10) == pytest.approx(0.1)
    assert settle_window(0.2, [], 10) == pytest.approx(0.6)
    assert settle_window(0.001, [0.0, 0.1, 0.2], 10) == pytest.approx(0.2)
    assert settle_window(0.001, [0.0, 1000.0], 10) == pytest.approx(2.0)  # capped at timeout/5


def test_parse_entry_rejects_hostile_values():
    ident = Identity()
    good = {"v": 1, "m": [ident.peer_id.to_bytes(), ["127.0.0.1", 5], 1.0], "t": 1.0, "w": 5.0, "d": False}
    assert parse_entry(good, ident.peer_id) is not None
    assert parse_entry(good, Identity().peer_id) is None  # claims someone else
    for bad in (None, 3, {}, dict(good, v=2), dict(good, m=[b"x", None, 1.0]), dict(good, t="now"),
                dict(good, w=float("nan")), dict(good, w=-1), dict(good, d=1),
                dict(good, m=[ident.peer_id.to_bytes(), ["h", 70000], 1.0])):
        assert parse_entry(bad, ident.peer_id) is None


def test_schema_hash_and_messages():
    assert SCHEMA.hash == mlp_schema().hash and len(SCHEMA.hash) == 16
    assert SCHEMA.numel == 64 * 16 + 64 + 640
    wide, int8 = mlp_schema(32), mlp_schema(codec="int8")
    assert len({SCHEMA.hash, wide.hash, int8.hash}) == 3
    msg = schema_mismatch_message(SCHEMA, wide.summary(), peer="X", run=PREFIX)
    assert msg.startswith("peer X averages 'digits-mlp' with a different model: "
                          "layer fc1.weight is [64, 32] there and [64, 16] here")
    msg = schema_mismatch_message(SCHEMA, int8.summary(), peer="X", run=PREFIX)
    assert "uses codec int8, we use fp16" in msg
    assert "malformed" in schema_mismatch_message(SCHEMA, {"hash": 3})
    many = tensor_schema([torch.zeros(2)] * 100, "none")
    other = tensor_schema([torch.zeros(2)] * 60 + [torch.zeros(2, dtype=torch.float16)] + [torch.zeros(2)] * 39, "none")
    assert "tensor #60 differs" in schema_mismatch_message(many, other.summary(entries=8))
    assert "float32" in SCHEMA.describe() and "fc1.weight [64, 16]" in SCHEMA.describe()


# ---------------------------------------------------------------------------- with a swarm


async def test_four_peers_form_one_group_fast(swarm):
    make, mm = swarm
    peers = await make(4)
    mms = [mm(n) for n in peers]
    t0 = time.monotonic()
    async with asyncio.timeout(10):
        groups = await asyncio.gather(*(m.form_group(1, timeout=8.0) for m in mms))
    elapsed = time.monotonic() - t0
    assert len({g.group_id for g in groups}) == 1
    assert all(g == groups[0] for g in groups)
    assert groups[0].size == 4 and len(groups[0].group_id) == 16
    assert_consistent(groups, peers)
    assert elapsed < 2.0, f"forming a group of 4 took {elapsed:.2f} s"


async def test_ten_peers_target_four_balanced(swarm):
    make, mm = swarm
    peers = await make(10)
    mms = [mm(n, target_group_size=4) for n in peers]
    async with asyncio.timeout(12):
        groups = await asyncio.gather(*(m.form_group("r", timeout=8.0) for m in mms))
    by_id = assert_consistent(groups, peers)
    sizes = sorted(g.size for g in by_id.values())
    assert sizes == [3, 3, 4], sizes


async def test_lone_peer_returns_itself_at_deadline(swarm):
    make, mm = swarm
    (peer,) = await make(1)
    m = mm(peer)
    t0 = time.monotonic()
    async with asyncio.timeout(3):
        group = await m.form_group(7, timeout=1.0)
    elapsed = time.monotonic() - t0
    assert group.size == 1 and group.members[0].peer_id == peer.peer_id
    assert 0.8 <= elapsed <= 1.4, elapsed


async def test_min_size_waits_for_a_late_third_instead_of_pairing(swarm):
    """With ``min_size=3`` two early peers keep gathering (a pair is no group) until the third
    arrives after their settle window, and all three form one group; alone, they would have paired."""
    make, mm = swarm
    peers = await make(3)
    mms = [mm(n) for n in peers]
    async with asyncio.timeout(12):
        early = [asyncio.create_task(m.form_group("late", timeout=6.0, min_size=3)) for m in mms[:2]]
        await asyncio.sleep(1.0)  # the scenario: the third arrives well after the first two settled
        assert not any(t.done() for t in early)
        groups = [*await asyncio.gather(mms[2].form_group("late", timeout=6.0, min_size=3), *early)]
    assert [g.size for g in groups] == [3, 3, 3]
    assert_consistent(groups, peers)
    async with asyncio.timeout(12):
        pairs = await asyncio.gather(*(m.form_group("pair", timeout=6.0) for m in mms[:2]))
    assert [g.size for g in pairs] == [2, 2]


@pytest.mark.parametrize("other", ["shape", "codec"])
async def test_different_schemas_never_group(swarm, other, caplog):
    make, mm = swarm
    a, b, c = await make(3)
    theirs = mlp_schema(32) if other == "shape" else mlp_schema(codec="int8")
    ma, mb, mc = mm(a), mm(b, schema=theirs), mm(c, schema=theirs)
    with caplog.at_level(logging.WARNING, logger="p2ptrain.matchmaking"):
        async with asyncio.timeout(5):
            ga, gb, gc = await asyncio.gather(*(m.form_group(3, timeout=1.5) for m in (ma, mb, mc)))
    assert ga.size == 1
    assert gb == gc and gb.size == 2
    expected = ("layer fc1.weight is [64, 32] there and [64, 16] here" if other == "shape"
                else "uses codec int8, we use fp16")
    mism = ma.mismatches()
    assert set(mism) == {str(b.peer_id), str(c.peer_id)}
    assert all(expected in msg and PREFIX in msg for msg in mism.values())
    assert str(a.peer_id) in mb.mismatches()
    # warned once per peer, even though the round was read many times
    warnings = [r for r in caplog.records if r.name == "p2ptrain.matchmaking" and str(b.peer_id) in r.getMessage()]
    assert len(warnings) == 1 and expected in warnings[0].getMessage()


async def test_join_with_wrong_schema_gets_clear_error(swarm):
    make, mm = swarm
    a, b = await make(2)
    mm(a)
    args = {"v": 1, "prefix": PREFIX, "schema": mlp_schema(32).hash, "round": "1",
            "member": Member(b.peer_id, None).to_wire(), "remaining": 1.0}
    with pytest.raises(RPCError, match="schema mismatch.*same model"):
        await b.host.call(a.peer_id, (a.multiaddrs[0].host, a.multiaddrs[0].port), JOIN_METHOD, args, timeout=2)
    for bad in (None, {"prefix": PREFIX}, dict(args, schema=SCHEMA.hash, member=[b"x", None, 1.0]),
                dict(args, schema=SCHEMA.hash, member=Member(a.peer_id, None).to_wire())):
        with pytest.raises(RPCError):
            await b.host.call(a.peer_id, None, JOIN_METHOD, bad, timeout=2)


async def test_a_join_before_the_joiners_entry_is_readable_does_not_freeze_the_leader():
    """A join can come before the joiner's entry is readable (both leave at once), or from a peer
    that never registers. The gathering peer must not spin on it: its wait on the join hint
    returned at once, and with no DHT contacts its reads never yield, so the whole event loop
    froze until the deadline. Here the joiner is a client-mode peer that never registers."""
    gatherer = DHTNode(config=FAST)
    await gatherer.start()  # alone: client-mode peers are not routable, so it has no contact at all
    stray = DHTNode(config=FAST, listen=None)
    matchmaker = Matchmaker(gatherer, PREFIX, SCHEMA)
    try:
        await stray.start(gatherer.multiaddrs)
        loop = asyncio.get_running_loop()
        forming = asyncio.ensure_future(matchmaker.form_group("stray", timeout=2.0))
        await asyncio.sleep(0.1)
        args = {"v": 1, "prefix": PREFIX, "schema": SCHEMA.hash, "round": "stray",
                "member": Member(stray.peer_id, None).to_wire(), "remaining": 1.5}
        joining = asyncio.ensure_future(stray.host.call(gatherer.peer_id, None, JOIN_METHOD, args, timeout=1.5))
        gaps, last = [], loop.time()
        while not forming.done():  # the loop must keep turning while the peer gathers
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last)
            last = loop.time()
        assert (await forming).size == 1
        assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s"
        with pytest.raises(DHTError):  # refused as too late, or timed out at its own deadline
            await joining
    finally:
        await matchmaker.close()
        await stray.close()
        await gatherer.close()


async def test_client_mode_peer_joins_but_never_leads(swarm):
    make, mm = swarm
    servers = await make(2)
    clients = await make(1, listen=None)
    peers = servers + clients
    mms = [mm(n) for n in peers]
    for rnd in range(3):  # the leader is drawn afresh each round
        async with asyncio.timeout(10):
            groups = await asyncio.gather(*(m.form_group(f"c{rnd}", timeout=6.0) for m in mms))
        assert all(g == groups[0] for g in groups) and groups[0].size == 3
        leader = groups[0].members[0]
        assert leader.addr is not None and leader.peer_id != clients[0].peer_id
        client_member = next(m for m in groups[0].members if m.peer_id == clients[0].peer_id)
        assert client_member.addr is None and not client_member.owns_shard


async def test_leader_dying_before_answering(swarm):
    make, mm = swarm
    peers = await make(4)
    mms = [mm(n) for n in peers]
    round_id = "dead-leader"
    key = mms[0].round_key(round_id)
    me_all = [m.me() for m in mms]
    leader_idx = next(i for i, m in enumerate(me_all) if m.peer_id == plan_groups(me_all, key, 16)[0][0].peer_id)
    leader_node, leader_mm = peers[leader_idx], mms[leader_idx]
    killed = asyncio.Event()
    tasks: list[asyncio.Task] = []
    done_at: dict[int, float] = {}

    async def die_on_first_join(conn, args):
        # the leader's process dies with the joins in flight: no answer, connections reset
        if not killed.is_set():
            killed.set()
            tasks[leader_idx].cancel()
            asyncio.get_running_loop().create_task(leader_node.close())
        await asyncio.sleep(3600)

    leader_mm._on_join = die_on_first_join  # type: ignore[method-assign]
    timeout = 4.0

    async def timed(i: int, m: Matchmaker) -> Group:
        g = await m.form_group(round_id, timeout=timeout)
        done_at[i] = time.monotonic() - t0
        return g

    t0 = time.monotonic()
    async with asyncio.timeout(timeout + 1):
        tasks.extend(asyncio.ensure_future(timed(i, m)) for i, m in enumerate(mms))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert killed.is_set() and isinstance(results[leader_idx], asyncio.CancelledError)
    survivors = [(g, n) for i, (g, n) in enumerate(zip(results, peers)) if i != leader_idx]
    assert all(isinstance(g, Group) for g, _ in survivors)
    assert max(done_at.values()) < timeout / 2, done_at  # they regrouped, not waited out the deadline
    groups = [g for g, _ in survivors]
    for g in groups:
        assert leader_node.peer_id not in {m.peer_id for m in g.members}
    assert_consistent(groups, [n for _, n in survivors])
    assert groups[0].size == 3 and all(g == groups[0] for g in groups)  # survivors regroup


async def test_a_leader_that_missed_a_peer_waits_for_it_when_a_joiner_names_it(swarm):
    """A leader whose view lacks a peer (its read missed that entry) plans a smaller group, and
    closed it as soon as the joiner it expected came: the peer it missed, planned into the same group
    by the others, was refused and ended alone. Joiners now name whom they planned with them."""
    make, mm = swarm
    peers = await make(3)
    mms = [mm(n) for n in peers]
    me_all = [m.me() for m in mms]
    round_id = "missed"
    leader_id = plan_groups(me_all, mms[0].round_key(round_id), 16)[0][0].peer_id
    a = next(i for i, m in enumerate(me_all) if m.peer_id == leader_id)
    b, c = [i for i in range(3) if i != a]
    read, local = mms[a].board.read, mms[a].board.local

    async def blind(rnd, deadline):  # the leader never sees c's entry
        return {p: e for p, e in (await read(rnd, deadline)).items() if p != peers[c].peer_id}

    mms[a].board.read = blind
    mms[a].board.local = lambda rnd: {p: e for p, e in local(rnd).items() if p != peers[c].peer_id}

    async def late(i: int, delay: float, **kw) -> Group:
        await asyncio.sleep(delay)
        return await mms[i].form_group(round_id, timeout=4.0, **kw)

    async with asyncio.timeout(6):
        groups = await asyncio.gather(late(a, 0.0), late(b, 0.0, expected=3), late(c, 0.0))  # c settles longer
    assert [g.size for g in groups] == [3, 3, 3] and all(g == groups[0] for g in groups)
    assert groups[0].members[0].peer_id == leader_id


async def test_staggered_arrivals_form_one_group(swarm):
    make, mm = swarm
    peers = await make(5)
    mms = [mm(n) for n in peers]
    delays = [0.0, 0.3, 0.075, 0.225, 0.15]  # arrivals 75 ms apart over 300 ms, in shuffled order

    async def late(m: Matchmaker, delay: float) -> Group:
        await asyncio.sleep(delay)
        return await m.form_group("stagger", timeout=6.0)

    async with asyncio.timeout(8):
        groups = await asyncio.gather(*(late(m, d) for m, d in zip(mms, delays)))
    assert all(g == groups[0] for g in groups) and groups[0].size == 5


async def test_garbage_in_the_round_key_is_ignored(swarm):
    make, mm = swarm
    a, b, hostile = await make(3)
    ma, mb = mm(a), mm(b)
    key = ma.round_key("g")
    sub = hostile.owned("m")
    exp = time.time() + 30
    # a malformed value under its own sub-key, and an entry claiming to be peer a
    await hostile.store(key, {"v": 1, "m": "garbage"}, exp, subkey=sub)
    await hostile.store(key + "x", 1, exp)
    await hostile.store(key, {"v": 1, "m": Member(a.peer_id, ("127.0.0.1", 1)).to_wire(), "t": time.time(),
                              "w": 5.0, "d": False}, exp + 1, subkey=sub)
    async with asyncio.timeout(6):
        ga, gb = await asyncio.gather(ma.form_group("g", timeout=4.0), mb.form_group("g", timeout=4.0))
    assert ga == gb and ga.size == 2


async def test_close_cancels_and_refuses(swarm):
    make, mm = swarm
    a, b = await make(2)
    ma, mb = mm(a), mm(b)
    async with asyncio.timeout(5):
        ga, gb = await asyncio.gather(ma.form_group(0, timeout=3.0), mb.form_group(0, timeout=3.0))
    assert ga == gb and ga.size == 2
    await ma.close()
    assert not ma._tasks
    with pytest.raises(RuntimeError):
        await ma.form_group(1, timeout=1.0)


def slow_link(monkeypatch, peers: list[DHTNode], rtt: float = 0.5) -> float:
    """Every RPC pays an emulated round trip of ``rtt`` s (half each way); returns it. Long enough
    that the CPU of ~100 RPCs in one event loop is small against it on a loaded box."""
    for node in peers:
        node.config = dataclasses.replace(node.config, rpc_timeout=4 * rtt)
    call = Host.call

    async def slow_call(self, *args, **kwargs):
        await asyncio.sleep(rtt / 2)  # the emulated link, not a synchronisation
        result = await call(self, *args, **kwargs)
        await asyncio.sleep(rtt / 2)
        return result

    monkeypatch.setattr(Host, "call", slow_call)
    return rtt


async def test_a_round_takes_about_two_round_trips_on_a_slow_link(swarm, monkeypatch):
    """Every RPC pays an emulated round trip (half each way). Peers that arrive together and expect
    each other write their entries and read the holders at once (one round trip), then join their
    leader (one more): ~2 round trips, where a lookup before the write and a read after it took ~4.
    A peer that comes later is seen by the others as its entry lands on their nodes (they all hold
    the key), half a round trip after it left, not at the answer of a read (a round trip or more)."""
    make, mm = swarm
    peers = await make(4)
    rtt = slow_link(monkeypatch, peers)
    mms = [mm(n) for n in peers]
    async with asyncio.timeout(10):
        groups = await asyncio.gather(*(m.form_group(1, timeout=8.0, expected=4) for m in mms))
    assert_consistent(groups, peers)
    assert groups[0].size == 4
    trips = max(m.last_stats["seconds"] for m in mms) / rtt
    assert trips < 3.0, f"matchmaking took {trips:.2f} round trips"

    async def timed(m: Matchmaker, delay: float) -> float:
        await asyncio.sleep(delay)
        start = time.monotonic()
        await m.form_group(2, timeout=8.0, expected=4)
        return start

    async with asyncio.timeout(10):
        starts = await asyncio.gather(*(timed(m, 1.5 * rtt if i == 3 else 0.0) for i, m in enumerate(mms)))
    seen = [(starts[i] + mms[i].last_stats["marks"]["all_seen"] - starts[3]) / rtt for i in range(3)]
    assert max(seen) < 0.9, f"the others saw the last peer {seen} round trips after it started"


async def test_entries_go_straight_to_the_mates_so_a_cell_away_from_its_keys_holders_meets_sooner(swarm, monkeypatch):
    """Two peers of a 12-node swarm meet under a key whose 8 holders they are not (a mixing-grid
    cell in a large swarm). Told of each other as ``mates``, each writes its entry to the other
    too: the first sees the late one half a round trip after it started (not at a read's answer,
    a round trip or more later), and the late one, finding the first's entry on its own node,
    plans at once, before its first read of the holders comes back."""
    make, mm = swarm
    peers = await make(11)
    everyone = {n.peer_id: Contact(n.peer_id, (n.multiaddrs[0].host, n.multiaddrs[0].port)) for n in peers}
    round_id = "cell"
    holders = {c.peer_id for c in DHTNode.nearest(f"{PREFIX}/avg/{SCHEMA.hash}/{round_id}", everyone.values(), 8)}
    a, b = [n for n in peers if n.peer_id not in holders][:2]  # (3 of the 11 hold no copy)
    mma, mmb = mm(a), mm(b)
    assert mma.round_key(round_id) == f"{PREFIX}/avg/{SCHEMA.hash}/{round_id}"
    rtt = slow_link(monkeypatch, peers)

    async def form(m: Matchmaker, mate: Contact, delay: float) -> float:
        await asyncio.sleep(delay)  # the scenario: the second peer ends its epoch later
        start = time.monotonic()
        await m.form_group(round_id, timeout=8.0, expected=2, mates=[mate])
        return start

    async with asyncio.timeout(12):
        sa, sb = await asyncio.gather(form(mma, everyone[b.peer_id], 0.0), form(mmb, everyone[a.peer_id], 1.5 * rtt))
    assert mma.last_stats["group_size"] == mmb.last_stats["group_size"] == 2
    seen = (sa + mma.last_stats["marks"]["all_seen"] - sb) / rtt
    assert seen < 0.9, f"the first saw the late peer {seen:.2f} round trips after it started"
    assert mmb.last_stats["marks"]["planned"] < 0.5 * rtt, mmb.last_stats["marks"]


async def test_the_wait_for_an_expected_straggler_follows_the_arrival_spread_of_recent_rounds(swarm):
    """Two peers expect a third that comes 0.8 s after them. The first round they wait the least
    grace (0.5 s) and pair without it; they see its entry land afterwards, so the next round, with
    the same straggler, they wait long enough for it and all three meet."""
    make, mm = swarm
    peers = await make(3)
    mms = [mm(n) for n in peers]
    lag = 0.8

    async def form(i: int, round_id: str) -> Group:
        if i == 2:
            await asyncio.sleep(lag)  # the scenario: a peer that ends its epoch late
        return await mms[i].form_group(round_id, timeout=5.0, expected=3)

    async with asyncio.timeout(12):
        first = await asyncio.gather(*(form(i, "s0") for i in range(3)))
        assert [g.size for g in first] == [2, 2, 1]
        second = await asyncio.gather(*(form(i, "s1") for i in range(3)))
    assert [g.size for g in second] == [3, 3, 3] and all(g == second[0] for g in second)


async def test_a_join_does_not_end_the_gather_of_a_peer_that_still_misses_peers_it_expects(swarm):
    """One peer, told to expect two (a stale view of the swarm), plans without the third and joins
    its leader. The leader expects three: it stopped gathering at that join and closed without the
    third, which came 0.3 s later and ended alone. It now waits for it, within its grace."""
    make, mm = swarm
    peers = await make(3)
    mms = [mm(n) for n in peers]
    key = mms[0].round_key("stale")
    a, b, c = sorted(range(3), key=lambda i: score(peers[i].peer_id, key))  # a leads any plan it is in

    async def form(i: int, delay: float, expected: int) -> Group:
        await asyncio.sleep(delay)
        return await mms[i].form_group("stale", timeout=5.0, expected=expected)

    async with asyncio.timeout(8):
        groups = await asyncio.gather(form(a, 0.0, 3), form(b, 0.05, 2), form(c, 0.3, 3))
    assert [g.size for g in groups] == [3, 3, 3] and all(g == groups[0] for g in groups)
