"""Contribution receipts (issue 32): every member of a round signs what the group agreed each member
contributed; a line counts when a majority of the group signed it.

* receipts verify; a changed body or a signature by someone else is refused;
* a member that inflates its own line (``receipt_inflate``), signs two versions, or invents a group
  naming an honest peer, gets nothing the majority did not sign;
* a member that sends NaN parts, or an owner that tampers with its shard, shows as excluded, and why;
* receipts in the DHT and in a file are read back and verified; a peer that left is still credited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch
from test_allreduce import Swarm, data, run_all

from dht import DHTConfig, DHTNode, Identity
from p2ptrain.averaging import Group, StepResult, partition
from p2ptrain.averaging.round_types import AllReduceConfig, AllReduceResult, ShardResult
from p2ptrain.contrib import ContributionBook, Line, build_receipt, leaderboard, parse_signed, read_file, sign
from p2ptrain.contrib.book import read_receipts
from p2ptrain.contrib.receipt import Receipt
from p2ptrain.testing.hostile import MODES

pytestmark = [pytest.mark.usefixtures("loop_errors"), pytest.mark.timeout(60)]

CFG = AllReduceConfig(chunk_numel=256, timeout=8.0, join_timeout=2.0, stall_timeout=1.0)
RUN = "run/sync"


@pytest.fixture
async def swarm():
    s = Swarm()
    yield s
    await s.close()


async def declared_round(swarm, n: int, ws: list[float], **kw):
    """A group of ``n`` whose members declared ``ws`` (as matchmaking has them), run once; returns
    (group, identities, results)."""
    group, hosts, services = await swarm.group(n, config=CFG)
    group = Group(group.group_id, tuple(dataclasses.replace(m, weight=w) for m, w in zip(group.members, ws)))
    for hook in kw.pop("hostile", []):
        hook(services)
    xs, _ = data(n, 3000, seed=2)
    results = await run_all(group, services, [x.clone() for x in xs], ws, "none", **kw)
    return group, [h.identity for h in hosts], results


def signed_all(results, identities, round_id: str = "e1"):
    return [sign(build_receipt(r, RUN, round_id, identities[r.rank].peer_id, 1000.0 + r.rank), identities[r.rank])
            for r in results]


def by_peer(rows):
    return {r.peer: r for r in rows}


async def test_receipts_verify_and_a_majority_credits_each_member(swarm):
    ws = [32.0, 64.0, 16.0, 32.0]
    group, ids, results = await declared_round(swarm, 4, ws)
    signed = signed_all(results, ids)
    assert len({s.receipt.lines for s in signed}) == 1, "every member computes the same lines"
    for s in signed:
        assert parse_signed(s.to_wire()) == s
    rows = by_peer(leaderboard(signed))
    for m, w in zip(group.members, ws):
        assert (rows[m.peer_id].rounds, rows[m.peer_id].samples, rows[m.peer_id].exclusions) == (1, int(w), 0)
        assert rows[m.peer_id].first_seen == rows[m.peer_id].last_seen
    # two signatures of four are no majority: nothing counts
    assert all(r.rounds == 0 and r.unconfirmed == 1 for r in leaderboard(signed[:2]))
    assert all(r.rounds == 1 for r in leaderboard(signed[:3]))


async def test_forged_and_changed_receipts_are_refused(swarm):
    _, ids, results = await declared_round(swarm, 3, [8.0, 8.0, 8.0])
    s = signed_all(results, ids)[0]
    by, body, sig = s.to_wire()
    inflated = body.replace(b"\x08", b"\x7f")  # the samples (8) as 127
    assert inflated != body and parse_signed([by, inflated, sig]) is None
    assert parse_signed([ids[1].peer_id.to_bytes(), body, sig]) is None, "another signer's name on our signature"
    mallory = Identity()  # signs a receipt naming the group's members, as if it were member 0
    forged = dataclasses.replace(s.receipt, signer=mallory.peer_id)
    with pytest.raises(ValueError):
        sign(forged, ids[0])
    assert parse_signed([ids[0].peer_id.to_bytes(), forged.to_body(), mallory.sign(b"p2ptrain/receipt/1\n" + body)]) \
        is None
    assert parse_signed(sign(forged, mallory).to_wire()) is None, "a signer outside the group"


async def test_an_inflated_or_equivocating_receipt_gains_nothing(swarm):
    ws = [10.0, 10.0, 10.0, 10.0, 10.0]
    group, ids, results = await declared_round(swarm, 5, ws)
    honest = signed_all(results, ids)

    class Book:  # what receipt_inflate rewrites: a book's receipt of one round
        def _receipt(self, result, run, compute_s):
            return build_receipt(result.allreduce, run, result.round_id, ids[4].peer_id, 1004.0)
    book = Book()
    MODES["receipt_inflate"].run(book)
    step = StepResult("e1", 5, list(results[4].members), allreduces=[results[4]])
    lie = sign(book._receipt(step, RUN, 0.0), ids[4])
    assert lie.receipt.lines[4].samples == 1000
    rows = by_peer(leaderboard(honest[:4] + [lie]))
    assert rows[ids[4].peer_id].samples == 10, "the majority's line, not the liar's"
    # equivocation: two different receipts of one group by one signer count for neither
    other = dataclasses.replace(honest[3].receipt, time=2000.0)
    assert all(r.rounds == 1 for r in leaderboard(honest[:2] + [honest[3]])), "three of five"
    rows = leaderboard(honest[:2] + [honest[3], sign(other, ids[3])])
    assert all(r.rounds == 0 for r in rows), "members 0 and 1 only: member 3 counts for neither version"


async def test_a_made_up_group_cannot_lower_an_honest_peers_credit(swarm):
    ws = [20.0, 20.0, 20.0]
    group, ids, results = await declared_round(swarm, 3, ws)
    honest = signed_all(results, ids)
    victim = ids[0].peer_id
    sybils = [Identity(), Identity()]
    peers = (victim, *(s.peer_id for s in sybils))
    lines = (Line(victim, 1, True), Line(peers[1], 999, False), Line(peers[2], 999, False))
    gid = os.urandom(16)
    fake = [sign(Receipt(RUN, "e1", gid, lines, s.peer_id, 1000.0, {0: "nan"}), s) for s in sybils]
    rows = by_peer(leaderboard(honest + fake))
    assert (rows[victim].samples, rows[victim].exclusions, rows[victim].rounds) == (20, 0, 1)
    assert rows[peers[1]].samples == 999, "sybils credit themselves: receipts say what a majority signed"


async def test_a_nan_sender_shows_as_excluded_for_nan(swarm):
    nan = torch.full((CFG.chunk_numel,), float("nan")).numpy()

    def hostile(services):
        services[3]._outgoing = lambda owner, ci, views: [memoryview(nan).cast("B")[: len(v)] for v in views]
    group, ids, results = await declared_round(swarm, 4, [5.0, 5.0, 5.0, 5.0], hostile=[hostile])
    rows = by_peer(leaderboard(signed_all(results, ids)))
    bad = rows[group.members[3].peer_id]
    a, b = partition(3000, group.members)[3]  # only its own shard's average holds its part
    assert (bad.samples, bad.exclusions, dict(bad.reasons)) == (round(5 * (b - a) / 3000), 1, {"nan": 1})
    assert all(rows[m.peer_id].samples == 5 and rows[m.peer_id].exclusions == 0 for m in group.members[:3])


async def test_a_tampering_owner_shows_as_excluded_by_its_audit(swarm):
    group, ids, results = await declared_round(swarm, 5, [4.0] * 5, aggregation="trimmed_mean",
                                               hostile=[lambda s: MODES["owner_tamper"].run(s[4])])
    rows = by_peer(leaderboard(signed_all(results, ids)))
    bad = rows[group.members[4].peer_id]
    assert (bad.samples, bad.exclusions, dict(bad.reasons)) == (0, 1, {"audit": 1})
    assert all(rows[m.peer_id].samples == 4 for m in group.members[:4])


async def test_a_robust_rule_credits_at_most_the_median_weight(swarm):
    group, ids, results = await declared_round(swarm, 3, [10.0, 20.0, 1000.0], aggregation="median")
    rows = by_peer(leaderboard(signed_all(results, ids)))
    assert [rows[m.peer_id].samples for m in group.members] == [10, 20, 20]


async def test_receipts_in_the_dht_and_on_disk_credit_a_peer_that_left(swarm, tmp_path):
    group, ids, results = await declared_round(swarm, 3, [7.0, 7.0, 7.0])
    nodes = []
    for i in range(3):
        node = DHTNode(ids[i], ("127.0.0.1", 0), config=DHTConfig(rpc_timeout=2.0))
        await node.start([nodes[0].multiaddrs[0]] if nodes else [])
        nodes.append(node)
    reader = DHTNode(Identity(), None, config=DHTConfig(rpc_timeout=2.0))
    await reader.start([nodes[0].multiaddrs[0]])
    books = [ContributionBook(nodes[i], "run", name=f"peer{i}", path=tmp_path / f"r{i}.jsonl") for i in range(3)]
    try:
        for book, r in zip(books, results):
            if book is not books[0]:  # peer 0 keeps its receipts in its file only, then leaves
                await book.start()
            book.record(StepResult("e1", 3, list(r.members), bytes_sent=r.bytes_sent, allreduces=[r]), RUN, 1.5)
        for book in books[1:]:
            await book.publish()
        await nodes[0].close()
        signed, names = await asyncio.wait_for(read_receipts(reader, "run"), 10)
        assert names == {ids[1].peer_id: "peer1", ids[2].peer_id: "peer2"}
        rows = by_peer(leaderboard(signed, names))
        assert rows[ids[0].peer_id].samples == 7 and rows[ids[0].peer_id].compute_s == 0.0, "credited by the others"
        assert rows[ids[1].peer_id].compute_s == 1.5 and rows[ids[1].peer_id].bytes_sent == results[1].bytes_sent > 0
        on_disk = read_file(tmp_path / "r0.jsonl")
        assert [s.receipt for s in on_disk] == [books[0].kept[0].receipt]
        lines = (tmp_path / "r0.jsonl").read_text().replace('"sig": "', '"sig": "AAAA')
        (tmp_path / "bad.jsonl").write_text(lines)
        assert read_file(tmp_path / "bad.jsonl") == []
    finally:
        for book in books[1:]:
            await book.close()
        for node in [reader, *nodes[1:]]:
            await node.close()


def test_a_round_in_slices_credits_the_part_of_every_slice_that_holds_a_members_values():
    ids = [Identity() for _ in range(3)]

    def slice_result(contributors: list[list[int]]) -> AllReduceResult:
        shards = [ShardResult(o, 100 * o, 100 * o + 100, "ok", 100, c) for o, c in enumerate(contributors)]
        return AllReduceResult(b"g" * 16, 3, tuple(i.peer_id for i in ids), 0, shards, {}, 1.0,
                               weights=(30.0, 30.0, 30.0))
    first, second = slice_result([[0, 1, 2]] * 3), slice_result([[0, 1, 2], [0, 1, 2], [0, 1]])
    r = build_receipt(first, RUN, "e1", ids[0].peer_id, 0.0, slices=[first, second])
    assert [(ln.samples, ln.excluded) for ln in r.lines] == [(30, False), (30, False), (25, True)]
    assert r.why == {2: "missing"}
