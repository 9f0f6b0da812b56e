"""Relayed connections (dht.relay): a peer that accepts no connections, reached through a relay.

In-process tests run a relay, a client-mode "NATed" host and a dialer on 127.0.0.1 in one loop,
each bounded by ``asyncio.timeout``; the ``world`` fixture closes every host and checks that no
task is left. The last test runs three processes in the network-namespace test bed, where host 2
really takes no inbound TCP connection (root only; skipped elsewhere).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

import dht.relay as relay_mod
from dht.errors import HandshakeError, MultiaddrError, PeerIdMismatch, PeerUnreachable, ProtocolError, RPCTimeout
from dht.identity import Identity, PeerID
from dht.limits import Limits
from dht.multiaddr import Multiaddr
from dht.node import DHTNode
from dht.relay import RelayRefused, RelayService, Reservations, relayed_via
from dht.stream import Stream
from dht.transport import Host

MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("loop_errors")

RELAY, TARGET = Identity().peer_id, Identity().peer_id


# ------------------------------------------------------------------------------ circuit multiaddrs


def test_circuit_multiaddr_round_trips_and_names_its_parts() -> None:
    text = f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}"
    addr = Multiaddr.parse(text)
    assert str(addr) == text
    assert addr.is_circuit and addr.relay_id == RELAY and addr.peer_id == TARGET
    assert (addr.host, addr.port) == ("10.0.0.1", 4001)  # the relay's socket
    assert addr.relay_addr == Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}")
    assert addr.relay_addr.circuit(TARGET) == addr
    assert not addr.relay_addr.is_circuit
    assert Multiaddr.parse(f"/dns4/relay.example.com/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}/").is_circuit


@pytest.mark.parametrize("text, words", [
    (f"/ip4/10.0.0.1/tcp/4001/p2p-circuit/p2p/{TARGET}", "must follow the relay's /p2p/<relay id>"),
    (f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit", "must be followed by /p2p/<peer id>"),
    (f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/tcp/5", "must be followed by /p2p/<peer id>"),
    (f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}/p2p-circuit/p2p/{RELAY}", "must be followed"),
    (f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{RELAY}", "the same peer"),
    (f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/notanid", "notanid"),
])
def test_bad_circuit_multiaddrs_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(MultiaddrError) as err:
        Multiaddr.parse(text)
    assert words in str(err.value)


def test_circuit_of_a_circuit_or_of_an_anonymous_relay_is_refused() -> None:
    circuit = Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}")
    with pytest.raises(MultiaddrError, match="relays do not chain"):
        circuit.circuit(Identity().peer_id)
    with pytest.raises(MultiaddrError, match="relay's /p2p/<id>"):
        Multiaddr.parse("/ip4/10.0.0.1/tcp/4001").circuit(TARGET)
    with pytest.raises(MultiaddrError, match="is not a circuit"):
        _ = Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}").relay_addr


def test_reservations_expire_refresh_and_fill_up() -> None:
    table = Reservations(max_reservations=2, ttl=10.0)
    a, b, c = (Identity().peer_id for _ in range(3))
    assert table.reserve(a, "conn-a", now=0.0) == 10.0
    table.reserve(b, "conn-b", now=1.0)
    with pytest.raises(RelayRefused, match="relay is full: 2 reservations"):
        table.reserve(c, "conn-c", now=2.0)
    assert table.reserve(a, "conn-a2", now=5.0) == 15.0  # a refresh is not a new slot
    assert table.lookup(a, now=14.0) == "conn-a2"
    assert table.lookup(b, now=11.0) is None  # expired
    table.reserve(c, "conn-c", now=11.0)  # b's slot is free again
    assert len(table) == 2
    table.drop(a)
    assert table.lookup(a, now=12.0) is None


# ------------------------------------------------------------------------------ in-process world


@dataclass
class World:
    relay: Host
    service: RelayService
    nat: Host
    dialer: Host
    circuit: Multiaddr
    extra: list[Host] = field(default_factory=list)


@pytest.fixture
async def world_factory():
    hosts: list[Host] = []
    services: list[RelayService] = []

    async def make(limits: Limits | None = None, service_cls: type[RelayService] = RelayService,
                   **service_kw: Any) -> World:
        relay = Host(Identity(), limits=limits)
        nat = Host(Identity(), listen=None, limits=limits)
        dialer = Host(Identity(), limits=limits)
        for h in (relay, nat, dialer):
            hosts.append(h)
            await h.start()
        service = service_cls(relay, **service_kw)
        services.append(service)
        service.start()
        circuit = await nat.reserve_relay(relay.listen_addrs[0])
        return World(relay, service, nat, dialer, circuit)

    async def host(listen: tuple[str, int] | None = ("127.0.0.1", 0)) -> Host:
        h = Host(Identity(), listen=listen)
        hosts.append(h)
        await h.start()
        return h

    make.host = host  # type: ignore[attr-defined]
    yield make
    for s in services:
        await s.close()
    for h in hosts:
        await h.close()
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert left == [], f"tasks left after closing every host: {left}"


async def _echo(conn: Any, args: Any) -> Any:
    return {"echo": args, "from": conn.remote_peer.to_bytes()}


def _pattern(seed: int, n: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}/{counter}".encode()).digest() * 1024
        counter += 1
    return bytes(out[:n])


async def test_client_mode_host_is_reached_through_its_circuit_address(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory()
        assert w.nat.client_mode
        assert w.circuit == w.relay.listen_addrs[0].circuit(w.nat.peer_id)
        assert w.nat.listen_addrs == [w.circuit]  # what a client-mode host now announces
        w.nat.on_request("echo", _echo)

        conn = await w.dialer.connect_addr(Multiaddr.parse(str(w.circuit)))
        assert conn.remote_peer == w.nat.peer_id and relayed_via(conn) == w.relay.peer_id
        assert conn.remote_host is None  # no IP address of the peer's: the DHT will not route to one
        assert await conn.call("echo", [1, "two"]) == {"echo": [1, "two"], "from": w.dialer.peer_id.to_bytes()}
        # registered like any connection: host.call, and the other side sees the dialer
        assert w.dialer.connection(w.nat.peer_id) is conn
        assert (await w.dialer.call(w.nat.peer_id, None, "echo", 3))["echo"] == 3
        back = w.nat.connection(w.dialer.peer_id)
        assert back is not None and relayed_via(back) == w.relay.peer_id
        w.dialer.on_request("echo", _echo)
        assert (await back.call("echo", "reverse"))["from"] == w.nat.peer_id.to_bytes()
        # a second connect_addr reuses the circuit
        assert await w.dialer.connect_addr(w.circuit) is conn


async def test_streams_over_a_circuit_are_bit_exact_both_ways(world_factory, monkeypatch) -> None:
    up, down = _pattern(1, 3 * MiB + 12345), _pattern(2, 2 * MiB + 777)
    received: dict[str, bytes] = {}
    seen_by_relay = bytearray()

    async def recording_pump(src: Stream, dst: Stream, budget: Any) -> None:
        while (chunk := await src.read()) is not None:
            seen_by_relay.extend(chunk)
            await dst.write(chunk)
        dst.write_eof()

    monkeypatch.setattr(relay_mod, "_pump", recording_pump)

    async def swap(stream: Stream) -> None:
        received["up"] = bytes(await stream.read_all(8 * MiB, timeout=15))
        await stream.write(down)

    async with asyncio.timeout(30):
        w: World = await world_factory()
        w.nat.on_stream("swap", swap)
        conn = await w.dialer.connect_addr(w.circuit)
        stream = await conn.open_stream("swap", {"n": len(up)})
        # written in uneven pieces: frames of the relayed connection span the relay's frames
        for i in range(0, len(up), 700_001):
            await stream.write(up[i:i + 700_001], timeout=15)
        stream.write_eof()
        got = bytes(await stream.read_all(8 * MiB, timeout=15))
    assert received["up"] == up
    assert got == down
    # all the relay had in its hands was ciphertext: no 64-byte run of either payload
    assert len(seen_by_relay) > len(up) + len(down)
    for data in (up, down):
        for at in (0, 4096, len(data) // 2, len(data) - 64):
            assert data[at:at + 64] not in seen_by_relay
    # the relay carried ciphertext, a bit more than the payload: framing, tags, handshake
    relayed = w.relay.connection(w.dialer.peer_id)
    assert relayed is not None and relayed.bytes_received > len(up)


async def test_dht_rpcs_run_over_a_circuit(world_factory) -> None:
    async with asyncio.timeout(20):
        dialer = await world_factory.host()
        # a DHT node relays; a client-mode DHT node joins through it and reserves a slot there
        relay, node = DHTNode(), DHTNode(listen=None)
        service = RelayService(relay.host)
        try:
            await relay.start()
            service.start()
            await node.start([relay.multiaddrs[0]])
            circuit = await node.host.reserve_relay(relay.multiaddrs[0])
            assert node.client_mode and node.multiaddrs == [circuit]
            conn = await dialer.connect_addr(circuit)
            assert await conn.call("ping", None) is None
            contacts = await conn.call("find_node", bytes(32))
            # the node knows the relay (its bootstrap peer) and tells us so: real DHT state
            assert [c[0] for c in contacts] == [relay.peer_id.to_bytes()]
        finally:
            await service.close()
            await node.close()
            await relay.close()


# ------------------------------------------------------------------------------ relayed DHT contacts


def test_contacts_with_relays_round_trip_on_the_wire_and_bad_ones_are_refused() -> None:
    from dht.protocol import decode_contacts, encode_contacts
    from dht.routing import Contact

    relay = Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}")
    other = Identity().peer_id
    nat = Contact(TARGET, None, relays=(relay.circuit(TARGET),))
    both = Contact(other, ("10.0.0.2", 5), relays=(relay.circuit(other),))
    plain = Contact(RELAY, ("10.0.0.1", 4001))
    wire = encode_contacts([nat, both, plain, Contact(Identity().peer_id, None)])
    assert len(wire) == 3 and len(wire[2]) == 3  # a direct contact keeps the old 3-field form
    back = decode_contacts(wire, 20)
    assert [(c.peer_id, c.addr, c.relays) for c in back] == [(c.peer_id, c.addr, c.relays) for c in (nat, both, plain)]
    circuit = str(relay.circuit(TARGET))
    for bad, words in [
        ([TARGET.to_bytes(), None, None, []], "malformed peer entry"),  # no way to reach it
        ([TARGET.to_bytes(), None, None, [str(relay)]], "not a circuit address"),
        ([TARGET.to_bytes(), None, None, [str(relay.circuit(other))]], "not a circuit address of"),  # someone else's
        ([TARGET.to_bytes(), None, None, [circuit] * 5], "at most 4"),
        ([TARGET.to_bytes(), None, None, ["/ip4/" + "1" * 400]], "at most 300"),
        ([TARGET.to_bytes(), None, None, circuit], "must be a list"),
        ([TARGET.to_bytes(), "h", True, [circuit]], "malformed peer entry"),
    ]:
        with pytest.raises(ProtocolError, match=words):
            decode_contacts([bad], 20)


def test_relayed_contacts_are_cached_by_circuit_and_hearsay_cannot_move_them() -> None:
    from dht.peercache import cache_entries
    from dht.routing import Contact, RoutingTable, node_id_of

    relay = Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}")
    own = Identity().peer_id
    table = RoutingTable(node_id_of(own))
    nat = Contact(TARGET, None, relays=(relay.circuit(TARGET),))
    assert table.update(nat, now=1.0) is None and TARGET in table  # dialable through its relay
    assert table.update(Contact(Identity().peer_id, None), now=1.0) is None and len(table) == 1  # not dialable
    assert cache_entries(table, own) == [relay.circuit(TARGET)]
    # a third party naming the NAT'd peer at its own "relay" is corrected to what the table holds
    liar = Multiaddr.parse(f"/ip4/10.6.6.6/tcp/1/p2p/{Identity().peer_id}")
    [vouched] = table.vouched([Contact(TARGET, None, relays=(liar.circuit(TARGET),))])
    assert vouched.relays == nat.relays and vouched.addr is None


async def test_a_peer_behind_nat_is_a_full_dht_member_reached_through_relays(world_factory) -> None:
    """Two public nodes (both relay) and two that announce no address (``reachable=False``): the
    NAT'd ones reserve at the public ones, are learnt as relayed contacts, answer lookups, hold
    records, and reach each other through a relay."""
    async with asyncio.timeout(30):
        public = [DHTNode(), DHTNode()]
        nat = [DHTNode(reachable=False), DHTNode(reachable=False)]
        services = [RelayService(p.host) for p in public]
        try:
            await public[0].start()
            await public[1].start([public[0].multiaddrs[0]])
            for s in services:
                s.start()
            for n in nat:
                await n.start([public[0].multiaddrs[0]])
            for n in nat:
                assert n.multiaddrs and all(a.is_circuit for a in n.multiaddrs)  # no direct address announced
                assert {a.relay_id for a in n.multiaddrs} == {p.peer_id for p in public}  # config.relays = 2
                for p in public:  # learnt with its circuit addresses, not its (useless) socket address
                    contact = p.routing.get(n.peer_id)
                    assert contact is not None and contact.addr is None and set(contact.relays) == set(n.multiaddrs)
            # nat[1] stores; nat[0] reads it back: the record went to every node through relays
            assert await nat[1].store("k", "v", time.time() + 60) == 4
            assert nat[0].storage.get(b"k", time.time())
            # ... through a relay (on loopback a hole punch may have added a direct one since)
            to_nat0 = [c for c in nat[1].host._all if c.remote_peer == nat[0].peer_id]
            assert {relayed_via(c) for c in to_nat0} & {p.peer_id for p in public}
            found = await public[1].get("k", latest=True)
            assert found is not None and found.value == "v"
            # find_node replies carry the relayed contacts
            reply = await public[1].host.call(public[0].peer_id, None, "find_node", bytes(32))
            assert {bytes(c[0]) for c in reply if len(c) == 4} == {n.peer_id.to_bytes() for n in nat}
        finally:
            for s in services:
                await s.close()
            for n in (*nat, *public):
                await n.close()


async def test_a_nated_node_that_loses_its_relay_reserves_at_another(world_factory) -> None:
    from dht.config import DHTConfig

    async with asyncio.timeout(30):
        public = [DHTNode(), DHTNode()]
        nat = DHTNode(reachable=False, config=DHTConfig(relays=1, maintenance_period=0.2))
        services = [RelayService(p.host) for p in public]
        try:
            await public[0].start()
            await public[1].start([public[0].multiaddrs[0]])
            for s in services:
                s.start()
            await nat.start([public[0].multiaddrs[0]])
            [first] = nat.multiaddrs
            lost, other = (0, 1) if first.relay_id == public[0].peer_id else (1, 0)
            moved = asyncio.Event()  # the other public node is told nat's circuit through itself
            public[other].host.on_connect.append(
                lambda c: moved.set() if any(r.relay_id == public[other].peer_id for r in c.remote_relays) else None)
            await services[lost].close()
            await public[lost].close()
            await moved.wait()
            assert [a.relay_id for a in nat.multiaddrs] == [public[other].peer_id]
        finally:
            for s in services:
                await s.close()
            for n in (nat, *public):
                await n.close()


async def test_peers_learn_a_relayed_hosts_circuit_addresses_as_they_change(world_factory) -> None:
    w = await world_factory()
    async with asyncio.timeout(20):
        seen: asyncio.Queue[tuple] = asyncio.Queue()
        w.dialer.on_connect.append(lambda c: seen.put_nowait(c.remote_relays) if c.remote_peer == w.nat.peer_id else 0)
        await w.nat.connect_addr(w.dialer.listen_addrs[0])
        assert await seen.get() == (w.circuit,)  # from the handshake
        relay2 = await world_factory.host()
        service2 = RelayService(relay2)
        service2.start()
        second = await w.nat.reserve_relay(relay2.listen_addrs[0])
        assert set(await seen.get()) == {w.circuit, second}  # pushed once the reservation holds
        await relay2.close()  # the connection to relay 2 ends: its reservation with it
        assert await seen.get() == (w.circuit,)
        await service2.close()


async def test_a_relay_that_alters_a_byte_breaks_the_connection_instead_of_delivering_it(
        world_factory, monkeypatch) -> None:
    async def flipping_pump(src: Stream, dst: Stream, budget: Any) -> None:
        seen = 0
        while (chunk := await src.read()) is not None:
            data = bytearray(chunk)
            if seen < 100_000 <= seen + len(data):  # well past the handshake, inside a stream frame
                data[100_000 - seen] ^= 0x01
            seen += len(data)
            await dst.write(data)
        dst.write_eof()

    got = bytearray()
    done = asyncio.Event()

    async def sink(stream: Stream) -> None:
        try:
            async for chunk in stream:
                got.extend(chunk)
        finally:
            done.set()

    payload = _pattern(3, 2 * MiB)
    async with asyncio.timeout(20):
        w: World = await world_factory()
        w.nat.on_stream("sink", sink)
        w.nat.on_request("echo", _echo)
        conn = await w.dialer.connect_addr(w.circuit)
        assert (await conn.call("echo", 1))["echo"] == 1  # the circuit works before the tampering
        monkeypatch.setattr(relay_mod, "_pump", flipping_pump)  # circuits set up from now on tamper
        conn.close("redial")
    accepted: list[Any] = []
    w.nat.on_connect.append(accepted.append)
    async with asyncio.timeout(20):
        conn = await w.dialer.connect_addr(w.circuit)
        stream = await conn.open_stream("sink")
        with pytest.raises(PeerUnreachable):
            await stream.write(payload, timeout=10)
            stream.write_eof()
            await stream.read(timeout=10)
        await done.wait()
    assert bytes(got) == payload[:len(got)] and len(got) < len(payload)  # a clean prefix, then nothing
    assert conn.is_closed and "connection lost" in (conn.close_reason or "")
    # the target's end caught it: the altered frame failed its authentication tag
    assert [c.close_reason for c in accepted] == ["frame failed authentication (corrupted or forged)"]


async def test_a_relay_cannot_substitute_the_target(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory()
        someone = Identity().peer_id
        # a lying relay: it forwards circuits for "someone" to the NATed host
        entry = w.service.reservations._by_peer[w.nat.peer_id]
        w.service.reservations._by_peer[someone] = entry
        with pytest.raises(PeerIdMismatch, match=f"dialed {someone} but reached {w.nat.peer_id}"):
            await w.dialer.connect_addr(w.relay.listen_addrs[0].circuit(someone))
        assert w.dialer.connection(someone) is None and w.dialer.connection(w.nat.peer_id) is None


async def test_a_relay_cannot_substitute_the_dialer(world_factory) -> None:
    impostor = Identity().peer_id

    class LyingRelay(RelayService):
        async def _open_stop(self, source: PeerID, target: PeerID) -> Any:
            return await super()._open_stop(impostor, target)  # names someone else as the dialer

    async with asyncio.timeout(20):
        w: World = await world_factory(service_cls=LyingRelay)
        lost = asyncio.Event()
        w.dialer.on_disconnect(lambda peer: lost.set() if peer == w.nat.peer_id else None)
        try:
            conn = await w.dialer.connect_addr(w.circuit)
        except (HandshakeError, PeerUnreachable):
            conn = None  # the target refused before our side completed: fine too
        if conn is not None:
            await lost.wait()  # the target refused the handshake: our half-open connection dies
        assert w.nat.connection(w.dialer.peer_id) is None and w.nat.connection(impostor) is None


async def test_reservations_beyond_the_limit_are_refused(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory(max_reservations=1)
        other = await world_factory.host(listen=None)
        with pytest.raises(RelayRefused, match="relay is full: 1 reservations held"):
            await other.reserve_relay(w.relay.listen_addrs[0])
        assert other.listen_addrs == []
        # without a reservation there is no circuit to it
        with pytest.raises(RelayRefused, match="has no reservation at this relay"):
            await w.dialer.connect_addr(w.relay.listen_addrs[0].circuit(other.peer_id))


async def test_circuits_beyond_the_limit_are_refused(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory(max_circuits=1)
        w.nat.on_request("echo", _echo)
        first = await w.dialer.connect_addr(w.circuit)
        second_dialer = await world_factory.host()
        with pytest.raises(RelayRefused, match="relay is busy: 1 circuits open"):
            await second_dialer.connect_addr(w.circuit)
        assert (await first.call("echo", "still fine"))["echo"] == "still fine"


async def test_the_circuit_byte_limit_ends_the_connection_with_a_clear_reason(world_factory) -> None:
    async def sink(stream: Stream) -> None:
        async for _chunk in stream:
            pass

    async with asyncio.timeout(20):
        w: World = await world_factory(circuit_bytes=1 * MiB)
        w.nat.on_stream("sink", sink)
        conn = await w.dialer.connect_addr(w.circuit)
        stream = await conn.open_stream("sink")
        with pytest.raises(PeerUnreachable):
            await stream.write(_pattern(4, 4 * MiB), timeout=10)
            stream.write_eof()
            await stream.read(timeout=10)
        assert conn.is_closed
        assert "relay circuit limit: more than 1048576 bytes relayed" in (conn.close_reason or "")


async def test_the_circuit_time_limit_ends_the_connection(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory(circuit_seconds=0.5)
        lost = asyncio.Event()
        w.dialer.on_disconnect(lambda peer: lost.set() if peer == w.nat.peer_id else None)
        conn = await w.dialer.connect_addr(w.circuit)
        await lost.wait()
        assert "open for more than 0.5 s" in (conn.close_reason or "")


async def test_the_target_going_away_resets_the_circuit_and_fails_calls_quickly(world_factory) -> None:
    started = asyncio.Event()

    async def hang(conn: Any, args: Any) -> None:
        started.set()
        await asyncio.Event().wait()

    async with asyncio.timeout(20):
        w: World = await world_factory()
        w.nat.on_request("hang", hang)
        conn = await w.dialer.connect_addr(w.circuit)
        call = asyncio.ensure_future(conn.call("hang", None, timeout=15))
        await started.wait()
        t0 = time.monotonic()
        await w.nat.close()
        with pytest.raises(PeerUnreachable):
            await call
        assert time.monotonic() - t0 < 2.0
        assert conn.is_closed
        with pytest.raises(RelayRefused, match="no reservation"):
            await w.dialer.connect_addr(w.circuit)


async def test_the_relay_going_away_ends_circuits_and_the_reservation_comes_back(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory()
        w.nat.on_request("echo", _echo)
        conn = await w.dialer.connect_addr(w.circuit)
        lost = asyncio.Event()
        w.dialer.on_disconnect(lambda peer: lost.set() if peer == w.nat.peer_id else None)
        # the NATed host's connection to the relay dies: the circuit over it dies with it...
        w.nat.connection(w.relay.peer_id).close("network blip", abort=True)
        await lost.wait()
        assert conn.is_closed
        # ...and the host reserves again at once (woken by the disconnect, not a timer)
        deadline = time.monotonic() + 5
        while w.nat.peer_id not in w.service.reservations._by_peer or w.nat.listen_addrs != [w.circuit]:
            assert time.monotonic() < deadline, "the reservation did not come back"
            await asyncio.sleep(0.02)
        again = await w.dialer.connect_addr(w.circuit)
        assert (await again.call("echo", "back"))["echo"] == "back"


async def test_a_slow_reader_holds_back_the_writer_across_the_relay(world_factory) -> None:
    """Flow control end to end: nothing piles up at the relay beyond the streams' windows."""
    release = asyncio.Event()

    async def slow(stream: Stream) -> None:
        await release.wait()
        async for _chunk in stream:
            pass

    window = 1 * MiB
    async with asyncio.timeout(20):
        w: World = await world_factory(limits=Limits(stream_window=window, write_buffer_high=256 * 1024))
        w.nat.on_stream("slow", slow)
        conn = await w.dialer.connect_addr(w.circuit)
        stream = await conn.open_stream("slow")
        with pytest.raises(RPCTimeout):  # the writer stalls: a bounded amount is in flight
            await stream.write(_pattern(5, 32 * MiB), timeout=1.0)
        assert stream.bytes_sent <= window  # the receiver's window, not what the relay would buffer
        release.set()


async def test_closing_the_relay_service_ends_its_circuits(world_factory) -> None:
    async with asyncio.timeout(20):
        w: World = await world_factory()
        conn = await w.dialer.connect_addr(w.circuit)
        lost = asyncio.Event()
        w.dialer.on_disconnect(lambda peer: lost.set() if peer == w.nat.peer_id else None)
        assert w.service.circuits == 1
        await w.service.close()
        await lost.wait()
        assert conn.is_closed and w.service.circuits == 0
        with pytest.raises(PeerUnreachable):
            await w.dialer.connect_addr(w.circuit)


async def test_a_peer_that_does_not_relay_says_so(world_factory) -> None:
    async with asyncio.timeout(20):
        plain, nat, dialer = (await world_factory.host(), await world_factory.host(listen=None),
                              await world_factory.host())
        with pytest.raises(RelayRefused, match="refused the reservation \\(is it running with --relay\\?\\)"):
            await nat.reserve_relay(plain.listen_addrs[0])
        assert nat.listen_addrs == []
        with pytest.raises(RelayRefused, match="does not relay"):
            await dialer.connect_addr(plain.listen_addrs[0].circuit(nat.peer_id))


def test_relay_service_needs_a_listening_host() -> None:
    with pytest.raises(ValueError, match="client-mode host cannot run a RelayService"):
        RelayService(Host(Identity(), listen=None))


@pytest.mark.parametrize("argv, words", [
    (["--client", "--relay"], "--relay needs a listening peer"),
    (["--client", "--relay-via", "/ip4/10.0.0.1/tcp/4001"], "give the relay's own full address"),
    (["--client", "--relay-via", f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{TARGET}"],
     "give the relay's own full address"),
])
def test_dht_command_refuses_relay_options_that_cannot_work(argv: list[str], words: str, capsys) -> None:
    from p2ptrain.cli import main

    assert main(["dht", *argv]) == 2
    assert words in capsys.readouterr().err


# ------------------------------------------------------------------------------ network namespaces

try:
    from p2ptrain.testing import Testbed, available
    _OK, _WHY = available()
except Exception as e:  # noqa: BLE001 - no test bed module or no Linux: skip with the reason
    _OK, _WHY = False, str(e)

_DIALER = r"""
import asyncio, json, sys
from dht import Host, Identity, Multiaddr, PeerUnreachable

async def main(direct, circuit):
    host = Host(Identity(), listen=None)
    await host.start()
    out = {}
    try:
        d = Multiaddr.parse(direct)
        try:
            await host.connect_addr(d, timeout=3.0)
            out["direct"] = "connected"
        except PeerUnreachable as e:
            out["direct"] = str(e)
        conn = await host.connect_addr(Multiaddr.parse(circuit), timeout=10.0)
        out["relayed_peer"] = str(conn.remote_peer)
        out["ping"] = await conn.call("ping", None, timeout=10.0)
        out["contacts"] = [[c[1], c[2]] for c in await conn.call("find_node", bytes(32), timeout=10.0)]
    finally:
        await host.close()
    print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


class _Lines:
    """A process in a test bed host whose stdout lines are queued by a reader thread."""

    def __init__(self, tb: Any, host: int, argv: list[str]):
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = tb.popen(host, argv, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line.strip())
        self.lines.put(None)

    def next(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            self.stderr.seek(0)
            raise AssertionError(f"pid {self.proc.pid}: no output line; stderr:\n{self.stderr.read()[-3000:]}")
        return line


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _OK, reason=f"no network namespaces here: {_WHY}")
def test_netns_peer_without_inbound_route_is_reached_through_a_relay(child_pids) -> None:
    before = child_pids()
    dht_cmd = [sys.executable, "-m", "p2ptrain", "dht", "--timeout", "20"]
    with Testbed(3, no_inbound=[2]) as tb:
        relay = _Lines(tb, 0, [*dht_cmd, "--listen", f"/ip4/{tb.hosts[0].ip}/tcp/0", "--relay"])
        relay_addr = relay.next(60)
        assert relay_addr.startswith(f"/ip4/{tb.hosts[0].ip}/tcp/"), relay_addr
        # host 2 listens, but no SYN reaches it: its direct address is useless, its circuit is not
        nat = _Lines(tb, 2, [*dht_cmd, "--listen", f"/ip4/{tb.hosts[2].ip}/tcp/0", "--bootstrap", relay_addr,
                             "--relay-via", relay_addr])
        direct, circuit = nat.next(60), nat.next(10)
        assert direct.startswith(f"/ip4/{tb.hosts[2].ip}/tcp/"), direct
        assert Multiaddr.parse(circuit) == Multiaddr.parse(relay_addr).circuit(Multiaddr.parse(direct).peer_id)
        out = tb.run(1, [sys.executable, "-c", _DIALER, direct, circuit], capture_output=True, text=True,
                     timeout=60)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "timed out" in result["direct"], result  # the SYN was dropped: no route in
    assert result["relayed_peer"] == str(Multiaddr.parse(direct).peer_id)
    assert result["ping"] is None
    # host 2's routing table, read through the circuit: it holds the relay (its bootstrap peer)
    assert [tb.hosts[0].ip, int(relay_addr.split("/")[4])] in result["contacts"], result
    assert child_pids() <= before


def test_transport_leaves_circuits_to_the_relay():
    """dht.transport imports nothing of dht.relay, not even inside a function: the relay registers
    itself as the transport of /p2p-circuit addresses, which every host then dials and listens on."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(relay_mod.__file__).parent / "transport.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in imported if m.split(".")[-1] == "relay"]
    assert isinstance(Host(Identity())._transport("p2p-circuit"), relay_mod.CircuitTransport)
