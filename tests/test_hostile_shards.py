"""Hostile members of an averaging group (issue 27, item 3 and item 9's weights), each attack a mode
of ``p2ptrain.testing.hostile.shards``:

* ``owner_tamper``: an owner's reply is not the rule over the parts. Under a robust rule every
  member audits the other owners (averaging/audit.py): the cheat is named in ``failed`` and its
  shard recomputed from the members' parts without it, also where only one chunk is drawn;
* ``audit_lie``: a member shows auditors other parts than it sent; no honest owner is named;
* ``bandwidth_inflate``: a claim of 1e14 owns at most twice the median member's share;
* ``leader_group_forge``: a leader that gives itself every shard in the group it hands out is refused;
* ``weight_inflate``: under ``mean`` a weight of 1e12 counts as 8 times the group's median weight.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from test_allreduce import Swarm, data, run_all

from dht import DHTConfig, DHTNode, Identity
from p2ptrain.averaging import Averager, Matchmaker, tensor_schema
from p2ptrain.averaging.round_types import AllReduceConfig
from p2ptrain.averaging.group import MAX_BANDWIDTH_RATIO, MAX_WEIGHT_RATIO, Member, partition
from p2ptrain.averaging.robust import aggregate
from p2ptrain.testing.hostile import MODES

pytestmark = pytest.mark.usefixtures("loop_errors")

CFG = AllReduceConfig(chunk_numel=256, timeout=8.0, join_timeout=2.0, stall_timeout=1.0)


@pytest.fixture
async def swarm():
    s = Swarm()
    yield s
    await s.close()


def rule_over(rule: str, xs, ws, ranks, a: int, b: int, cn: int) -> torch.Tensor:
    """The rule over ``ranks``' parts of [a, b), chunk by chunk, as an owner applies it."""
    out = torch.empty(b - a)
    for ca in range(a, b, cn):
        cb = min(ca + cn, b)
        x = torch.stack([xs[r][ca:cb] for r in ranks])
        out[ca - a : cb - a] = aggregate(rule, x, torch.tensor([ws[r] for r in ranks]))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
async def test_a_tampering_owner_is_named_and_its_shard_recomputed_without_it(swarm, rule):
    """5 members, rank 4 sends everyone its shard's result times -100. Its shard spans 5 chunks of
    which each member audits one: the first drawn exposes it, and the whole shard is redone."""
    async with asyncio.timeout(40):
        group, _, services = await swarm.group(5, config=CFG)
        MODES["owner_tamper"].run(services[4])
        xs, ws = data(5, 6000, seed=1)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, "none", aggregation=rule)
        bounds = partition(6000, group.members)
        a, b = bounds[4]
        assert (b - a) > 4 * CFG.chunk_numel
        want = rule_over(rule, xs, ws, [0, 1, 2, 3], a, b, CFG.chunk_numel)
        for r in range(4):
            torch.testing.assert_close(flats[r][a:b], want, atol=1e-5, rtol=1e-5)
            assert "failed the audit" in results[r].failed.get(4, ""), results[r].failed
            for j in range(4):  # honest owners: the rule over everyone, nobody else named
                ja, jb = bounds[j]
                torch.testing.assert_close(flats[r][ja:jb], rule_over(rule, xs, ws, range(5), ja, jb, CFG.chunk_numel),
                                           atol=1e-5, rtol=1e-5)
                assert j not in results[r].failed, results[r].failed


@pytest.mark.timeout(60)
async def test_a_tampered_run_as_long_as_the_audit_stride_is_always_found(swarm):
    """Under a coordinate-wise rule an auditor checks every 16th value of a chunk from a random
    offset: an owner that tampers with only the first 16 values of its reply is still caught."""
    async with asyncio.timeout(40):
        cfg = AllReduceConfig(chunk_numel=4096, timeout=8.0, join_timeout=2.0, stall_timeout=1.0)
        group, _, services = await swarm.group(4, config=cfg)
        assert services[0].audit.stride == 16
        MODES["owner_tamper"].run(services[3], first=16)
        xs, ws = data(4, 8000, seed=3)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, "none", aggregation="median")
        a, b = partition(8000, group.members)[3]
        for r in range(3):
            torch.testing.assert_close(flats[r][a:b], rule_over("median", xs, ws, [0, 1, 2], a, b, 4096))
            assert "failed the audit" in results[r].failed.get(3, ""), results[r].failed


@pytest.mark.timeout(60)
async def test_a_member_lying_to_auditors_frames_no_honest_owner(swarm):
    """Rank 4 shows auditors its parts times -100: the recomputations then differ from the honest
    owners' replies, but their copies of the parts clear them; the values stay within the range of
    the honest parts (the lie is just one more hostile row)."""
    async with asyncio.timeout(40):
        group, _, services = await swarm.group(5, config=CFG)
        MODES["audit_lie"].run(services[4])
        xs, ws = data(5, 6000, seed=2)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, "none", aggregation="trimmed_mean")
        honest = torch.stack(xs[:4])
        lo, hi = honest.min(0).values, honest.max(0).values
        for r in range(4):
            assert not any("audit" in why for why in results[r].failed.values()), results[r].failed
            assert bool(((flats[r] >= lo - 1e-5) & (flats[r] <= hi + 1e-5)).all())


def test_a_claimed_bandwidth_buys_at_most_twice_the_median_share():
    members = [Member(Identity().peer_id, ("127.0.0.1", 1000 + i), bw) for i, bw in enumerate([1.0, 1.0, 1.0, 1e14])]
    bounds = partition(1 << 20, members)
    share = (bounds[3][1] - bounds[3][0]) / (1 << 20)
    assert share <= MAX_BANDWIDTH_RATIO / (3 + MAX_BANDWIDTH_RATIO) + 1e-3, share


FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=0.5)
SCHEMA = tensor_schema([("w", torch.zeros(1000))], "none")


@pytest.fixture
async def nodes():
    started: list[DHTNode] = []

    async def make(n: int) -> list[DHTNode]:
        first = DHTNode(config=FAST)
        await first.start()
        rest = [DHTNode(config=FAST) for _ in range(n - 1)]
        await asyncio.gather(*(nd.start(first.multiaddrs) for nd in rest))
        started.extend([first, *rest])
        return [first, *rest]

    try:
        yield make
    finally:
        await asyncio.gather(*(nd.close() for nd in started), return_exceptions=True)


@pytest.mark.timeout(30)
async def test_an_inflated_bandwidth_claim_reaches_the_group_but_not_the_shards(nodes):
    peers = await nodes(4)
    mms = [Matchmaker(nd, "bw", SCHEMA) for nd in peers]
    MODES["bandwidth_inflate"].run(mms[3])
    try:
        async with asyncio.timeout(15):
            groups = await asyncio.gather(*(m.form_group("r", timeout=6.0, expected=4) for m in mms))
        assert all(g == groups[0] for g in groups) and groups[0].size == 4
        g = groups[0]
        rank = g.rank_of(peers[3].peer_id)
        assert g.members[rank].bandwidth == 1e14  # the claim as made: each owner caps it alike
        a, b = partition(1 << 20, g.members)[rank]
        assert (b - a) / (1 << 20) <= MAX_BANDWIDTH_RATIO / (3 + MAX_BANDWIDTH_RATIO) + 1e-3
    finally:
        await asyncio.gather(*(m.close() for m in mms))


@pytest.mark.timeout(30)
async def test_a_group_forged_by_its_leader_is_refused(nodes, caplog):
    """Every matchmaker forges when it leads; the joiners refuse the leader's group (it zeroes
    their bandwidths, against their registrations) and never run a round in it."""
    peers = await nodes(3)
    mms = [Matchmaker(nd, "forge", SCHEMA) for nd in peers]
    for m in mms:
        MODES["leader_group_forge"].run(m)
    try:
        with caplog.at_level(logging.WARNING, logger="p2ptrain.matchmaking"):
            async with asyncio.timeout(15):
                groups = await asyncio.gather(*(m.form_group("r", timeout=3.0, expected=3) for m in mms))
        for g, nd in zip(groups, peers):
            if g.members[0].peer_id != nd.peer_id:  # a joiner: what it took is no forgery
                assert all(m.bandwidth == 1.0 for m in g.members), g
        assert "refusing the group leader" in caplog.text
        assert "changed our own entry" in caplog.text or "differs from its registration" in caplog.text
    finally:
        await asyncio.gather(*(m.close() for m in mms))


@pytest.mark.timeout(30)
async def test_an_inflated_weight_under_mean_counts_as_eight_median_peers(nodes):
    peers = await nodes(4)
    tensors = [torch.full((1000,), float(i)) for i in range(4)]
    avgs = [Averager(nd, "wt", [t], codec="none", aggregation="mean") for nd, t in zip(peers, tensors)]
    MODES["weight_inflate"].run(avgs[3])
    try:
        async with asyncio.timeout(20):
            results = await asyncio.gather(*(a.step(weight=1.0, expected=4) for a in avgs))
        assert all(r.averaged and r.group_size == 4 for r in results), results
        want = (0 + 1 + 2 + 3 * MAX_WEIGHT_RATIO) / (3 + MAX_WEIGHT_RATIO)
        for t in tensors[:3]:
            torch.testing.assert_close(t, torch.full((1000,), want), atol=1e-4, rtol=0)
    finally:
        await asyncio.gather(*(a.close() for a in avgs))


@pytest.mark.timeout(60)
async def test_audit_requests_out_of_protocol_are_refused_and_good_ones_answered(swarm):
    """After a robust round, member 1 asks member 0 (which holds the round's ledger) for parts: a
    malformed request is reset, an item it does not hold is answered "not held", a stranger and a
    member past its stream allowance are refused; the service stays up for the next round."""
    from dht import StreamReset
    from p2ptrain.averaging.audit import AUDIT_PROTOCOL

    async with asyncio.timeout(40):
        group, hosts, services = await swarm.group(3, config=CFG)
        xs, ws = data(3, 3000, seed=4)
        await run_all(group, services, [x.clone() for x in xs], ws, "none", aggregation="median")
        owner0 = partition(3000, group.members)[0]

        async def ask(host, q, gid=group.group_id) -> bytes:
            conn = await host.connect("127.0.0.1", hosts[0].listen_port, hosts[0].peer_id)
            stream = await conn.open_stream(AUDIT_PROTOCOL, {"g": gid, "q": q})
            stream.write_eof()
            return bytes(await stream.read_all(1 << 22, timeout=5))

        # a good item: rank 1's row of chunk 0 of member 0's shard, every 16th value from 3
        got = await ask(hosts[1], [["r", 0, 1, 3, 16]])
        n = len(range(3, min(CFG.chunk_numel, owner0[1] - owner0[0]), 16))
        assert len(got) > 4 * n and torch.equal(torch.frombuffer(bytearray(got[-4 * n:]), dtype=torch.float32),
                                                xs[1][owner0[0] : owner0[0] + CFG.chunk_numel][3::16])
        assert b"not held" in await ask(hosts[1], [["s", 1, 99, 0, 1]])
        services[0].audit.max_streams = 10
        for bad in ("q", [["s", 0, 0, 0, 0]], [["x", 0, 0, 0, 1]], [["s", True, 0, 0, 1]], [["s", -1, 0, 0, 1]]):
            with pytest.raises(StreamReset, match="malformed audit request"):
                await ask(hosts[2], bad)
        services[0].audit.max_streams = 6  # (its own audit in the round took one: 6 so far)
        with pytest.raises(StreamReset, match="too many audit streams"):
            await ask(hosts[2], [["s", 1, 0, 0, 1]])
        with pytest.raises(StreamReset, match="no audited round"):
            await ask(hosts[1], [["s", 1, 0, 0, 1]], gid=b"\x00" * 16)
        stranger = await swarm.host()
        with pytest.raises(StreamReset, match="not a member"):
            await ask(stranger, [["s", 1, 0, 0, 1]])
        flats = [x.clone() for x in xs]
        nxt = type(group)(b"next round" + bytes(6), group.members)
        results = await run_all(nxt, services, flats, ws, "none", aggregation="median")
        assert all(r.ok and not r.failed for r in results)
