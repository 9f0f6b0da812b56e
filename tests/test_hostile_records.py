"""Issue 27, DHT layer: each attack of ``p2ptrain.testing.hostile.records`` against honest nodes.

Every test here failed before its defence (see the commit messages): a plain value erased owned
sub-keys (item 5), Sybils from one address filled a store (item 7), lookup replies rewrote and
evicted an honest peer's routing entry (item 8), and Sybils took every relay slot (item 9).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dht import DHTConfig, DHTNode, Host, Identity, RelayRefused, RelayService
from dht.quota import address_group
from dht.routing import node_id_of
from dht.storage import Record, RecordStore, owned_name, sign_record
from p2ptrain.testing.hostile import MODES
from p2ptrain.testing.hostile.records import (
    blackhole,
    plain_value_poison,
    relay_slot_sybil,
    reply_confusion,
    routing_poison,
    subkey_squat,
    sybil_store_flood,
)

FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=60.0)
ATTACKER_IP = "127.0.0.2"  # another loopback address: another address group than 127.0.0.1


def test_every_attack_here_is_a_registered_mode():
    for name in ("plain_value_poison", "subkey_squat", "sybil_store_flood", "routing_poison", "reply_confusion",
                 "relay_slot_sybil"):
        assert MODES[name].what


@pytest.fixture
async def nodes():
    made: list[DHTNode] = []

    async def make(n: int, config: DHTConfig = FAST, identities: list[Identity] | None = None,
                   via: DHTNode | None = None) -> list[DHTNode]:
        new = [DHTNode(identity=(identities or [None] * n)[i], config=config) for i in range(n)]
        for nd in new:
            await nd.start((via or made[0]).multiaddrs if made else ())
            made.append(nd)
        return new

    try:
        yield make
    finally:
        await asyncio.gather(*(nd.close() for nd in made), return_exceptions=True)


# ------------------------------------------------------------------ item 5: plain value over owned sub-keys


async def test_a_plain_value_cannot_erase_or_hide_owned_subkeys(nodes):
    a, b, attacker, reader = await nodes(4)
    key = "run/progress"
    exp = time.time() + 60
    for owner in (a, b):
        assert await owner.store(key, {"epoch": 3}, exp, subkey=owner.owned("p")) > 0
    async with asyncio.timeout(20):
        assert await plain_value_poison(attacker, key) <= 1  # only the attacker's own store took it
        got = await reader.get(key, latest=True)
        assert isinstance(got, dict) and {v.value["epoch"] for v in got.values()} == {3} and len(got) == 2
        assert await a.store(key, {"epoch": 4}, exp + 10, subkey=a.owned("p")) >= 3  # re-writes still land
        got = await reader.get(key, latest=True)
        assert got[a.owned("p")].value == {"epoch": 4}


async def test_a_plain_value_written_first_does_not_block_the_owners(nodes):
    """The round key of a future matchmaking round is predictable: poisoned before anyone wrote."""
    a, b, attacker, reader = await nodes(4)
    key = "run/mm/round/1234"
    async with asyncio.timeout(20):
        assert await plain_value_poison(attacker, key) >= 3
        exp = time.time() + 60
        for owner in (a, b):
            assert await owner.store(key, {"peer": owner.owned("m")}, exp, subkey=owner.owned("m")) >= 3
        got = await reader.get(key, latest=True)
        assert isinstance(got, dict) and set(got) == {a.owned("m"), b.owned("m")}


async def test_unsigned_subkeys_filling_a_key_give_way_to_the_owners(nodes):
    a, attacker, reader = await nodes(3, config=DHTConfig(rpc_timeout=1.0, maintenance_period=60.0))
    key = "run/mm/round/77"
    async with asyncio.timeout(30):
        assert await subkey_squat(attacker, key) >= 2000  # every other peer took all 1000
        assert await a.store(key, {"peer": 1}, time.time() + 60, subkey=a.owned("m")) >= 2
        got = await reader.get(key, latest=True)
        assert got[a.owned("m")].value == {"peer": 1}


def test_owned_subkeys_outrank_an_unsigned_plain_value_in_a_store():
    alice = Identity()
    now = 1000.0
    sub = sign_record(Record(b"k", owned_name(b"s", alice.peer_id), b"\x01", now + 10), alice)
    plain = Record(b"k", None, b"\x02", now + 80000)
    store = RecordStore()
    assert store.store(sub, now)
    with pytest.raises(Exception, match="holds owner-signed sub-keys"):
        store.store(plain, now)
    assert store.get(b"k", now) == [sub]
    store = RecordStore()
    assert store.store(plain, now) and store.store(sub, now)  # an owned sub-key displaces the plain value
    assert store.get(b"k", now) == [sub]


# ------------------------------------------------------------------ item 7: Sybil storage fill


@pytest.mark.parametrize("source_ip", [ATTACKER_IP, None], ids=["other-address", "same-address"])
async def test_a_sybil_store_flood_leaves_room_for_honest_stores(source_ip, loop_errors):
    config = DHTConfig(max_records=2000, max_records_per_source=100, rpc_timeout=2.0, maintenance_period=60.0)
    victim = DHTNode(config=config)
    await victim.start()
    honest = Host(Identity(), None)
    await honest.start()
    try:
        async with asyncio.timeout(60):
            flood = await sybil_store_flood(victim.multiaddrs[0], identities=40, records=100, source_ip=source_ip)
            assert flood.accepted >= config.max_records  # the flood did fill the store
            assert len(victim.storage) <= config.max_records
            batch = [Record(b"honest/%d" % i, None, b"\xa1v", time.time() + 60).to_wire() for i in range(50)]
            replies = await honest.call(victim.peer_id, ("127.0.0.1", victim.host.listen_port), "store", batch, 10)
            assert replies == [True] * 50
            assert len(victim.storage.get(b"honest/7", time.time())) == 1
    finally:
        await honest.close()
        await victim.close()


def test_one_address_group_cannot_push_out_another():
    """Sans-IO: 50 identities from one /24 against 3 honest peers from three others, bytes-bound."""
    now, value = 1000.0, b"x" * 4000
    store = RecordStore(max_bytes=1 << 20, max_records_per_source=1000)
    honest = [(Identity().peer_id, f"10.0.{i}.5") for i in range(3)]
    for i, (peer, ip) in enumerate(honest):
        for j in range(20):
            assert store.store(Record(b"h/%d/%d" % (i, j), None, value, now + 600), now, peer, address_group(ip))
    sybil_group = address_group("203.0.113.77")
    refused = 0
    for s in range(50):
        peer = Identity().peer_id
        for j in range(100):
            try:
                store.store(Record(b"s/%d/%d" % (s, j), None, value, now + 600), now, peer, sybil_group)
            except Exception:
                refused += 1
    assert store.bytes <= 1 << 20 and refused > 0
    assert all(store.get(b"h/%d/%d" % (i, j), now) for i in range(3) for j in range(20))  # nothing of theirs evicted
    peer, ip = honest[0]  # and they may still write, evicting the flood's records
    assert store.store(Record(b"h/0/new", None, value, now + 600), now, peer, address_group(ip))


def test_a_refused_write_keeps_what_it_would_have_replaced():
    now = 1000.0
    p, q = Identity().peer_id, Identity().peer_id
    store = RecordStore(max_records_per_source=1, max_bytes_per_source=2000)
    assert store.store(Record(b"a", None, b"p", now + 10), now, p, "g")
    assert store.store(Record(b"b", None, b"q", now + 10), now, q, "g")
    with pytest.raises(Exception, match=f"too many records from peer {q}"):
        store.store(Record(b"a", None, b"q2", now + 20), now, q, "g")  # newer, but q is at its quota
    assert [r.value for r in store.get(b"a", now)] == [b"p"] and len(store) == 2
    with pytest.raises(Exception, match="too many bytes from peer"):
        store.store(Record(b"c", None, b"x" * 1500, now + 10), now, Identity().peer_id, "g")


def test_address_groups():
    assert address_group("192.0.2.1") == address_group("192.0.2.200") == "192.0.2.0/24"
    assert address_group("192.0.3.1") != address_group("192.0.2.1")
    assert address_group("::ffff:192.0.2.9") == "192.0.2.0/24"
    assert address_group("2001:db8:1:2::5") == address_group("2001:db8:1:ffff::1") == "2001:db8:1::/48"
    assert address_group("127.0.0.1") != address_group("127.0.0.2")  # loopback: per address
    assert address_group(None, Identity().peer_id).startswith("relay ")


# ------------------------------------------------------------------ item 8: routing poisoning


def _identity_where(cond) -> Identity:
    while True:
        ident = Identity()
        if cond(node_id_of(ident.peer_id)):
            return ident


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "not-connected"])
async def test_lookup_replies_cannot_rewrite_or_evict_an_honest_peer(nodes, connected):
    """A1 and A2 sit close to the lookup target; A2 has left, A1 names the honest H at an address
    that never answers. The lookup then asks H there: that must neither become H's address in
    the victim's table nor count as H failing."""
    victim_id = Identity()
    top = node_id_of(victim_id.peer_id) >> 255
    other_half = _identity_where(lambda n: n >> 255 != top)
    a2 = _identity_where(lambda n: n >> 255 != top)
    h = _identity_where(lambda n: n >> 255 == top)
    (honest,) = await nodes(1, identities=[h])
    (victim,) = await nodes(1, config=DHTConfig(k=2, rpc_timeout=0.5, bootstrap_timeout=2.0, maintenance_period=60.0),
                            identities=[victim_id])
    a1, gone = await nodes(2, identities=[other_half, a2], via=victim)  # the victim learns them as they join
    assert {c.peer_id for c in victim.routing} == {honest.peer_id, a1.peer_id, gone.peer_id}
    real = victim.routing.get(honest.peer_id).addr
    await gone.close()
    with blackhole() as bogus:
        routing_poison(a1, honest.peer_id, bogus)
        for _ in range(3):
            conn = victim.host.connection(honest.peer_id)
            if not connected and conn is not None:
                conn.close("test: dial again")
                await asyncio.sleep(0)
            async with asyncio.timeout(10):
                await victim.find_peers(a1.node_id)
            contact = victim.routing.get(honest.peer_id)
            assert contact is not None, "the honest peer was evicted"
            assert contact.addr == real


# ------------------------------------------------------------------ item 4: reply confusion


async def test_a_reply_of_another_key_does_not_answer_a_lookup(nodes):
    owner, liar, reader = await nodes(3)
    key = owner.owned("ckpt/latest")
    reply_confusion(liar, b"ckpt/decoy")
    async with asyncio.timeout(20):
        assert await reader.get(key) is None
        await owner.store(key, {"epoch": 1}, time.time() + 60)
        got = await reader.get(key, latest=True)
        assert got is not None and got.value == {"epoch": 1}


# ------------------------------------------------------------------ item 9: relay slots


async def test_sybils_from_one_address_cannot_take_every_relay_slot(loop_errors):
    relay = Host(Identity())
    await relay.start()
    service = RelayService(relay, max_reservations=4)
    service.start()
    nat, dialer = Host(Identity(), None), Host(Identity())
    try:
        async with asyncio.timeout(30):
            async with relay_slot_sybil(relay.listen_addrs[0], 6, source_ip=ATTACKER_IP) as sybils:
                assert len(sybils) == 4  # an idle relay is theirs to fill
                for h in (nat, dialer):
                    await h.start()
                circuit = await nat.reserve_relay(relay.listen_addrs[0])  # another address still gets a slot
                conn = await dialer.connect_addr(circuit)
                assert conn.remote_peer == nat.peer_id
                assert len(service.reservations) == 4
    finally:
        await service.close()
        for h in (nat, dialer, relay):
            await h.close()


async def test_peers_of_one_address_share_the_relay_as_before(loop_errors):
    """On one address (a NAT, or 127.0.0.1) it is first come, first served: nobody is evicted."""
    relay = Host(Identity())
    await relay.start()
    service = RelayService(relay, max_reservations=2)
    service.start()
    late = Host(Identity(), None)
    try:
        async with asyncio.timeout(30):
            async with relay_slot_sybil(relay.listen_addrs[0], 2) as first:
                assert len(first) == 2
                await late.start()
                with pytest.raises(RelayRefused, match="relay is full"):
                    await late.reserve_relay(relay.listen_addrs[0])
    finally:
        await service.close()
        await late.close()
        await relay.close()
