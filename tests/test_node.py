"""DHTNode behaviour with several nodes in one event loop (the multi-process swarm has its own file)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dht import (
    BootstrapError,
    DHTConfig,
    DHTNode,
    Identity,
    InvalidRecord,
    Multiaddr,
    ProtocolError,
)
from dht.protocol import value_request
from dht.routing import key_id
from dht.storage import Record, sign_record
from dht.wire import pack

FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=0.2, republish_interval=0.5)


@pytest.fixture
async def swarm():
    nodes: list[DHTNode] = []

    async def make(n: int, config: DHTConfig = FAST, **kw) -> list[DHTNode]:
        if not nodes:
            first = DHTNode(config=config)
            await first.start()
            nodes.append(first)
            n -= 1
        boot = nodes[0].multiaddrs
        new = [DHTNode(config=config, **kw) for _ in range(n)]
        await asyncio.gather(*(nd.start(boot) for nd in new))
        nodes.extend(new)
        return new

    try:
        yield make, nodes
    finally:
        await asyncio.gather(*(nd.close() for nd in nodes), return_exceptions=True)


async def test_store_get_across_nodes(swarm):
    make, nodes = swarm
    await make(12)
    accepted = await nodes[3].store("answer", {"x": 42}, time.time() + 60)
    assert accepted >= min(len(nodes), FAST.k) // 2
    for nd in nodes:
        got = await nd.get("answer")
        assert got is not None and got.value == {"x": 42}


async def test_store_to_the_holders_a_lookup_of_the_key_just_found(swarm):
    """``store(closest=...)`` sends to the given holders without a lookup of its own (one round
    trip less), and every node still finds the record."""
    make, nodes = swarm
    await make(12)
    writer = nodes[5]
    holders = (await writer.lookup_value("answer2", latest=True)).closest
    assert holders and writer.peer_id not in {c.peer_id for c in holders}
    lookups = []
    real = writer._lookup_nodes

    async def counted(target):
        lookups.append(target)
        return await real(target)

    writer._lookup_nodes = counted  # type: ignore[method-assign]
    accepted = await writer.store("answer2", {"x": 7}, time.time() + 60, closest=holders)
    assert lookups == [] and accepted == len(holders) + 1  # the holders and our own copy
    for nd in nodes:
        got = await nd.get("answer2")
        assert got is not None and got.value == {"x": 7}


async def test_newer_value_wins_and_expiry(swarm):
    make, nodes = swarm
    await make(6)
    now = time.time()
    await nodes[1].store("k", "old", now + 30)
    await nodes[2].store("k", "new", now + 60)
    await nodes[3].store("k", "stale", now + 10)  # older expiration: rejected everywhere
    assert (await nodes[4].get("k", latest=True)).value == "new"
    await nodes[1].store("short", "v", now + 0.3)
    assert (await nodes[5].get("short")) is not None
    await asyncio.sleep(0.4)  # time must pass for a record to expire: there is no event to await
    assert await nodes[5].get("short") is None


async def test_subkeys_merge_from_many_writers(swarm):
    make, nodes = swarm
    await make(8)
    now = time.time()
    await asyncio.gather(*(nd.store("group", f"peer{i}", now + 60, subkey=f"s{i}") for i, nd in enumerate(nodes)))
    got = await nodes[0].get("group", latest=True)
    assert isinstance(got, dict)
    assert {k: v.value for k, v in got.items()} == {f"s{i}": f"peer{i}" for i in range(len(nodes))}


async def test_owned_subkey_only_writable_by_owner(swarm):
    make, nodes = swarm
    await make(6)
    owner, other = nodes[1], nodes[2]
    sub = owner.owned("progress")
    assert await owner.store("run/progress", {"epoch": 3}, time.time() + 60, subkey=sub) > 0
    with pytest.raises(InvalidRecord, match="owned by another peer"):
        await other.store("run/progress", {"epoch": 99}, time.time() + 120, subkey=sub)

    # A forged record sent straight to every node over the wire is refused by each of them.
    forged = sign_record(
        Record(b"run/progress", sub.encode(), b"\x81\xa5epoch\x63", time.time() + 120), other.identity
    )
    unsigned = Record(b"run/progress", sub.encode(), b"\x81\xa5epoch\x63", time.time() + 120)
    for target in nodes:
        if target is other:
            continue
        conn = await other.host.connect(target.multiaddrs[0].host, target.multiaddrs[0].port, target.peer_id)
        replies = await conn.call("store", [forged.to_wire(), unsigned.to_wire()])
        assert all(isinstance(r, str) and "owned key" in r for r in replies), replies
    got = await nodes[4].get("run/progress", latest=True)
    assert got[sub].value == {"epoch": 3}


async def test_owned_key_signed_by_owner(swarm):
    make, nodes = swarm
    await make(5)
    key = nodes[2].owned("ckpt/latest")
    await nodes[2].store(key, {"epoch": 7}, time.time() + 60)
    assert (await nodes[0].get(key)).value == {"epoch": 7}
    with pytest.raises(InvalidRecord):
        await nodes[3].store(key, {"epoch": 8}, time.time() + 60)


async def test_client_mode_node_can_store_and_get_but_is_not_routed_to(swarm):
    make, nodes = swarm
    await make(6)
    (client,) = await make(1, listen=None)
    assert client.client_mode and client.multiaddrs == []
    assert await client.store("from-client", [1, 2, 3], time.time() + 60) > 0
    assert (await nodes[2].get("from-client")).value == [1, 2, 3]
    await nodes[1].store("to-client", "hello", time.time() + 60)
    assert (await client.get("to-client")).value == "hello"
    for nd in nodes:
        if nd is not client:
            assert client.peer_id not in nd.routing


async def test_unreachable_bootstrap_fails_fast_with_clear_error():
    node = DHTNode(config=DHTConfig(bootstrap_timeout=1.0))
    dead = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/1/p2p/{Identity().peer_id}")
    start = time.monotonic()
    with pytest.raises(BootstrapError, match="could not reach any bootstrap peer"):
        await node.start([dead])
    assert time.monotonic() - start < 3.0


async def test_bootstrap_with_wrong_peer_id_is_refused(swarm):
    make, nodes = swarm
    await make(2)
    addr = nodes[0].multiaddrs[0].with_peer_id(Identity().peer_id)
    node = DHTNode(config=FAST)
    with pytest.raises(BootstrapError, match="reached"):
        await node.start([addr])


async def test_dead_peers_are_evicted_and_records_survive(swarm):
    make, nodes = swarm
    await make(10)
    await nodes[1].store("survivor", "yes", time.time() + 60)
    victims = nodes[2:5]
    for victim in victims:
        await victim.close()
    reader = nodes[-1]
    for _ in range(3):  # each lookup that meets a dead peer marks it failed
        assert (await reader.get("survivor", latest=True)).value == "yes"
    await reader.find_peers(reader.node_id)
    dead_ids = {v.peer_id for v in victims}
    known_dead = [c for c in reader.routing if c.peer_id in dead_ids]
    assert all(c.failures > 0 for c in known_dead)
    for _ in range(2):
        for v in victims:
            await reader.find_peers(v.node_id)
    assert not any(c.peer_id in dead_ids for c in reader.routing)


async def test_close_cancels_every_task():
    before = asyncio.all_tasks()
    a = DHTNode(config=FAST)
    await a.start()
    b = DHTNode(config=FAST)
    await b.start(a.multiaddrs)
    await b.store("x", 1, time.time() + 60)
    await asyncio.gather(a.close(), b.close())
    leftover = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    assert leftover == []


async def test_a_reply_record_of_another_key_is_no_answer(swarm):
    """A holder answers the lookup of an owned key with an unsigned record of another key: the
    reader must not take it (it used to return it as the owned key's value)."""
    make, nodes = swarm
    await make(4)
    owner, liar, reader = nodes[1], nodes[2], nodes[3]
    key = owner.owned("run/progress")
    decoy = Record(b"run/decoy", None, b"\x81\xa5epoch\xce\x7f\xff\xff\xff", time.time() + 120)

    async def answer_with_another_key(conn, args):
        return [[decoy.to_wire()], []]

    liar.host.on_request("find_value", answer_with_another_key)
    assert await reader.get(key) is None  # nobody stored the key: no value, not the decoy's
    await owner.store(key, {"epoch": 1}, time.time() + 60)
    got = await reader.get(key, latest=True)
    assert got is not None and got.value == {"epoch": 1}


async def test_forged_record_in_a_reply_cannot_shadow_the_owners(swarm):
    """A malicious node answers find_value with a forged, later-expiring copy of an owned record."""
    make, nodes = swarm
    await make(5)
    owner = nodes[1]
    key = owner.owned("ckpt/latest")
    await owner.store(key, {"epoch": 1}, time.time() + 60)
    forged = Record(key.encode(), None, b"\x81\xa5epoch\xcd\x03\xe7", time.time() + 120, signature=b"\x00" * 64)
    liar = nodes[2]

    async def lying_find_value(conn, args):
        return [[forged.to_wire()], []]

    liar.host.on_request("find_value", lying_find_value)
    for reader in nodes[3:]:
        got = await reader.get(key, latest=True)
        assert got is not None and got.value == {"epoch": 1}


async def test_a_latest_lookup_does_not_wait_out_a_silent_peers_rpc_timeout(swarm):
    """A peer that never answers find_value costs a lookup its adaptive timeout (measured round
    trips, at least ``hedge_floor``), not the RPC timeout: the next contact is asked meanwhile."""
    config = DHTConfig(rpc_timeout=9.0, bootstrap_timeout=2.0, maintenance_period=60.0, hedge_floor=0.05)
    make, nodes = swarm
    await make(6, config)
    asked = asyncio.Event()

    async def silent(conn, args):
        asked.set()
        await asyncio.Event().wait()  # never answers; cancelled when the connection closes

    mute = DHTNode(config=config)
    mute._rpc_find_value = silent  # type: ignore[method-assign]
    nodes.append(mute)
    await mute.start(nodes[0].multiaddrs)
    reader = nodes[2]
    assert await nodes[1].store("hedged", 5, time.time() + 60) >= 2
    assert mute.peer_id in reader.routing  # so that the lookup asks it
    t0 = time.monotonic()
    result = await reader.lookup_value("hedged", latest=True)
    elapsed = time.monotonic() - t0
    assert asked.is_set() and [r.value for r in result.records] == [b"\x05"]
    assert elapsed < config.rpc_timeout / 3, elapsed


async def test_a_latest_lookup_ends_without_a_straggler_once_half_the_closest_answered(swarm):
    """Every holder answering in a millisecond but one, whose reply takes a second: the lookup
    ends without it, long before its adaptive timeout (at least ``hedge_floor``) would."""
    config = DHTConfig(k=8, rpc_timeout=9.0, bootstrap_timeout=2.0, maintenance_period=60.0, hedge_floor=3.0)
    make, nodes = swarm
    await make(7, config)
    slow = DHTNode(config=config)
    answer = slow._rpc_find_value

    async def late(conn, args):
        await asyncio.sleep(1.0)
        return await answer(conn, args)

    slow._rpc_find_value = late  # type: ignore[method-assign]
    nodes.append(slow)
    await slow.start(nodes[0].multiaddrs)
    reader = nodes[5]
    assert await nodes[1].store("straggled", 5, time.time() + 60) >= 4
    assert slow.peer_id in reader.routing
    t0 = time.monotonic()
    result = await reader.lookup_value("straggled", latest=True)
    assert time.monotonic() - t0 < 0.5
    assert [r.value for r in result.records] == [b"\x05"]
    assert slow.peer_id not in {c.peer_id for c in result.closest}  # it never answered in time


async def test_republish_skips_keys_received_since_an_overrunning_rounds_start():
    """A round that took longer than the period must not make every holder republish every key:
    a key received since our previous round began was spread by its sender this cycle."""
    node = DHTNode(config=DHTConfig(republish_interval=0.1))  # not started: replication is stubbed
    for key in (b"fresh", b"stale"):
        node.storage.store(Record(key, None, b"\x01", time.time() + 60), time.time())
    sent: list[bytes] = []

    async def replicate(records, closest=None):
        sent.append(records[0].key)
        return 1

    node._replicate = replicate  # type: ignore[method-assign]
    node._republish_started = time.monotonic() - 10.0  # our last round began 10 periods ago...
    node._received_at = {b"fresh": time.monotonic() - 5.0, b"stale": time.monotonic() - 11.0}
    await node.republish()  # ...so "fresh", received since, is not ours to spread
    assert sent == [b"stale"]


async def test_find_value_names_only_the_contacts_nearer_than_asked_that_the_asker_lacks(swarm):
    """``value_request``'s bounds: contacts nearer the key than ``within`` and not among the asker's
    known ids; ``within=0``: records only. The plain form still names the k closest."""
    make, nodes = swarm
    await make(8)
    server, asker, key = nodes[0], nodes[1], b"bounded"
    full = server.routing.closest(key_id(key), FAST.k, exclude={asker.peer_id})
    assert len(full) >= 4
    ids = [c.peer_id.to_bytes() for c in full]

    async def named(args) -> list[bytes]:
        records, contacts = await asker.host.call(server.peer_id, None, "find_value", args, 2.0)
        return [c[0] for c in contacts]

    assert await named(key) == ids
    within = full[3].node_id ^ key_id(key)
    assert await named(value_request(key, within, [full[0].node_id])) == ids[1:3]
    assert await named(value_request(key, 0)) == []


def _serve_find_value(node: DHTNode, replies: list, older: bool = False) -> list:
    """Wrap ``node``'s find_value: the contacts of each reply go to ``replies``. ``older``: refuse
    every form but the plain key, as a peer from before ``value_request``'s bounds; returns the
    refused arguments."""
    honest, refused = node._rpc_find_value, []

    async def find_value(conn, args):
        if older and not isinstance(args, bytes):
            refused.append(args)
            raise ProtocolError("key must be bytes of at most 1024")
        reply = await honest(conn, args)
        replies.append(reply[1])
        return reply

    node.host.on_request("find_value", find_value)
    return refused


async def test_a_holder_read_asks_for_records_only_and_an_older_peer_is_still_read(swarm):
    """``get_owned(holders=...)`` asks each holder for records without contacts (none to look up
    or decode); a holder that refuses that form is asked again with the plain key."""
    make, nodes = swarm
    await make(6)
    reader = nodes[5]
    for i, writer in enumerate(nodes[1:4]):
        await writer.store_owned("members", "m", i, time.time() + 60)
    holders = (await reader.get_owned("members", "m")).closest
    by_id = {nd.peer_id: nd for nd in nodes}
    replies: list = []
    refused = _serve_find_value(by_id[holders[0].peer_id], [], older=True)
    for contact in holders[1:]:
        _serve_find_value(by_id[contact.peer_id], replies)
    read = await reader.get_owned("members", "m", holders=holders)
    assert sorted(v.value for v in read.values.values()) == [0, 1, 2]
    assert {c.peer_id for c in read.closest} == {c.peer_id for c in holders}  # the older one too
    assert len(refused) == 1 and len(replies) == len(holders) - 1 and not any(replies)


async def test_a_lookup_with_a_full_window_still_reads_an_older_peer(swarm):
    """k=4 among 10 nodes: a lookup's window is full from its first queries, so it asks in the
    bounded form; the key's only holder refuses that form, is asked again, and is read."""
    config = DHTConfig(k=4, rpc_timeout=2.0, hedge_floor=2.0, bootstrap_timeout=2.0, maintenance_period=60.0)
    make, nodes = swarm
    await make(10, config)
    key = b"fresh"
    older, *_, reader = sorted(nodes, key=lambda nd: nd.node_id ^ key_id(key))
    older.storage.store(Record(key, None, b"\x08", time.time() + 60), time.time())
    refused = _serve_find_value(older, [], older=True)
    result = await reader.lookup_value(key)
    assert [r.value for r in result.records] == [b"\x08"] and refused


async def test_a_latest_read_takes_the_newest_record_its_quorum_holds_not_one_only_farther_peers_hold(swarm):
    """k=8, so a latest read asks the key's nearest 4 (``read_window``): a newer record they hold
    wins; one only the 5th-8th nearest hold is missed (the quorum's price), which is why a store
    goes to all k."""
    config = DHTConfig(k=8, rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=60.0)
    make, nodes = swarm
    await make(9, config)  # (8 others: no bucket of the reader's can overflow)
    key, now = b"quorum", time.time()
    reader, *ranked = sorted(nodes, key=lambda nd: nd.node_id ^ key_id(key), reverse=True)
    ranked.reverse()  # the key's nearest first; the reader is the farthest
    for nd in ranked:  # so that the reader knows them all, and asks the nearest 4 only
        await (await nd.host.connect_addr(reader.multiaddrs[0], timeout=1.0)).call("ping", None, timeout=1.0)
    assert all(nd.peer_id in reader.routing for nd in ranked) and config.read_window == 4

    def hold(holders: list[DHTNode], value: int, ttl: float) -> None:
        for nd in holders:
            nd.storage.store(Record(key, None, pack(value), now + ttl), now)

    hold(ranked[:8], 1, 60)
    hold(ranked[:4], 2, 70)  # newer, on the quorum
    hold(ranked[4:8], 3, 80)  # newer still, beyond it
    result = await reader.lookup_value(key, latest=True)
    assert [r.value for r in result.records] == [pack(2)] and len(result.closest) <= 4
    assert await ranked[0].store(key, 4, now + 90) >= 5  # a store reaches all k
    assert (await reader.get(key, latest=True)).value == 4
