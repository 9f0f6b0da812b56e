"""Hole punching (dht.holepunch): a relayed connection to a peer behind NAT upgraded to a direct one.

The message checks are sans-IO; the loopback tests run the whole exchange (hosts that listen but
announce no address, ``reachable=False``, reached through a relay) in one event loop, each bounded by
``asyncio.timeout``; the last test runs DHT nodes in the network-namespace test bed behind real NAT
routers (root and pyroute2 only; skipped elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

import dht.holepunch as hp
from dht.connection import Connection
from dht.errors import ProtocolError, RPCError
from dht.identity import Identity
from dht.relay import RelayService, relayed_via
from dht.transport import Host

pytestmark = pytest.mark.usefixtures("loop_errors")


# ------------------------------------------------------------------------------ messages (sans-IO)


def test_addresses_are_validated_and_bounded() -> None:
    assert hp.parse_addrs([["10.0.0.1", 4001], ["::1", 5], ["10.0.0.1", 4001]]) == [("10.0.0.1", 4001), ("::1", 5)]
    for bad, words in [
        ("10.0.0.1:4001", "list"),
        ([["10.0.0.1", 1]] * (hp.MAX_ADDRS + 1), "at most"),
        ([["10.0.0.1"]], r"\[ip, port\]"),
        ([["10.0.0.1", 0]], r"\[ip, port\]"),
        ([["10.0.0.1", 70000]], r"\[ip, port\]"),
        ([["10.0.0.1", True]], r"\[ip, port\]"),
        ([["example.com", 1]], "not an IP address"),
        ([["0.0.0.0", 1]], "cannot be dialed"),
        ([["224.0.0.1", 1]], "cannot be dialed"),
    ]:
        with pytest.raises(ProtocolError, match=words):
            hp.parse_addrs(bad)
    assert hp.parse_connect({"addrs": [["10.0.0.1", 1]], "reachable": True}) == ([("10.0.0.1", 1)], True)
    assert hp.parse_connect({"addrs": []}) == ([], False)
    with pytest.raises(ProtocolError, match="bool"):
        hp.parse_connect({"addrs": [], "reachable": 1})
    with pytest.raises(ProtocolError, match="map"):
        hp.parse_connect([])


def test_candidates_try_the_listen_port_at_each_observed_address() -> None:
    observed = [("203.0.113.5", 40001), ("198.51.100.7", 4001)]
    assert hp.candidates(observed, 4001) == [("203.0.113.5", 4001), ("203.0.113.5", 40001), ("198.51.100.7", 4001)]
    assert hp.candidates(observed, None) == observed
    assert len(hp.candidates([(f"10.0.0.{i}", 1000 + i) for i in range(20)], 4001)) == hp.MAX_ADDRS


def test_the_side_that_sends_sync_waits_half_the_round_trip() -> None:
    assert hp.sync_delay(0.1) == pytest.approx(0.05)
    assert hp.sync_delay(-1.0) == 0.0


def test_the_host_remembers_a_few_observed_addresses_newest_first() -> None:
    host = Host(Identity())
    peers = [Identity().peer_id for _ in range(6)]
    for i, p in enumerate(peers):
        host.note_observed(p, ("10.0.0.1", 1000 + i % 2))
    host.note_observed(peers[0], ("10.0.0.9", 7))
    assert host.observed_addrs == [("10.0.0.9", 7), ("10.0.0.1", 1001), ("10.0.0.1", 1000)]


# ------------------------------------------------------------------------------ loopback


@pytest.fixture
async def hosts():
    made: list[Host] = []
    services: list[RelayService] = []

    async def make(*, relay: bool = False, reachable: bool = True) -> Host:
        h = Host(Identity(), reachable=reachable)
        made.append(h)
        await h.start()
        if relay:
            services.append(RelayService(h))
            services[-1].start()
        return h

    yield make
    for s in services:
        await s.close()
    for h in made:
        await h.close()
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert left == [], f"tasks left after closing every host: {left}"


def _direct_to(host: Host, peer: Any) -> asyncio.Event:
    """Set once ``host`` has a direct connection to ``peer``."""
    event = asyncio.Event()
    host.on_connect.append(lambda c: event.set() if c.remote_peer == peer and relayed_via(c) is None else None)
    return event


def _puncher(host: Host) -> hp.HolePuncher:
    return host._transport("p2p-circuit").puncher  # type: ignore[attr-defined]


def _stats(host: Host) -> hp.PunchStats:
    return hp.punch_stats(host)


async def test_two_nated_hosts_punch_a_direct_connection_and_keep_the_relay_as_fallback(hosts) -> None:
    async with asyncio.timeout(20):
        relay = await hosts(relay=True)
        a, b = await hosts(reachable=False), await hosts(reachable=False)
        circuit_a = await a.reserve_relay(relay.listen_addrs[0])
        circuit_b = await b.reserve_relay(relay.listen_addrs[0])
        # announced through the relay only; the relay told each where it sees it
        assert a.listen_addrs == [circuit_a] and [ip for ip, _ in b.observed_addrs] == ["127.0.0.1"]
        direct = _direct_to(a, b.peer_id)
        relayed = await a.connect_addr(circuit_b)
        assert relayed_via(relayed) == relay.peer_id
        await direct.wait()
        conn = a.connection(b.peer_id)
        assert conn is not None and relayed_via(conn) is None and conn.remote_peer == b.peer_id
        assert conn.initiator  # A (the dialer through the relay) is the Noise initiator
        b.on_request("echo", _echo)
        assert await a.call(b.peer_id, None, "echo", 7) == 7  # on the direct connection
        await _puncher(b).settled(a.peer_id)
        assert (_stats(b).attempts, _stats(b).direct, _stats(b).failed) == (1, 1, 0)
        assert _stats(a).attempts == 0  # counted once per pair, by the side that drives the punch
        # the relayed connection stays: losing the direct one falls back to it
        conn.close("test")
        await conn.aclose()
        assert a.connection(b.peer_id) is relayed and not relayed.is_closed
        assert await a.call(b.peer_id, None, "echo", 8) == 8


async def _echo(conn: Connection, args: Any) -> Any:
    return args


async def test_a_reachable_dialer_is_dialed_back_directly(hosts) -> None:
    async with asyncio.timeout(20):
        relay = await hosts(relay=True)
        a, b = await hosts(), await hosts(reachable=False)
        circuit_b = await b.reserve_relay(relay.listen_addrs[0])
        direct = _direct_to(a, b.peer_id)
        await a.connect_addr(circuit_b)
        await direct.wait()
        conn = a.connection(b.peer_id)
        assert conn is not None and relayed_via(conn) is None and not conn.initiator  # b dialed a
        await _puncher(b).settled(a.peer_id)
        assert (_stats(b).reversed, _stats(b).direct) == (1, 0)


async def test_a_punch_that_cannot_connect_leaves_the_relayed_connection(hosts, monkeypatch) -> None:
    async with asyncio.timeout(30):
        relay = await hosts(relay=True)
        a, b = await hosts(reachable=False), await hosts(reachable=False)
        await a.reserve_relay(relay.listen_addrs[0])
        circuit_b = await b.reserve_relay(relay.listen_addrs[0])
        closed = await hosts()
        port = closed.listen_port
        await closed.close()  # nothing listens there any more: every punch is refused
        monkeypatch.setattr(hp, "candidates", lambda observed, listen_port: [("127.0.0.1", port)])
        monkeypatch.setattr(hp, "GRACE", 0.05)
        done = asyncio.Event()
        original = hp.HolePuncher._upgrade

        async def upgrade(self: hp.HolePuncher, *args: Any) -> None:
            await original(self, *args)
            done.set()

        monkeypatch.setattr(hp.HolePuncher, "_upgrade", upgrade)
        relayed = await a.connect_addr(circuit_b)
        await done.wait()
        assert (_stats(b).attempts, _stats(b).direct, _stats(b).failed) == (1, 0, 1)
        assert a.connection(b.peer_id) is relayed and not relayed.is_closed


# ------------------------------------------------------------------------------ reachability (dht.autonat)


def test_reachable_if_any_peer_dialed_back_unknown_if_none_answered() -> None:
    from dht.autonat import verdict

    assert verdict([{"ok": False}, {"ok": True}]) is True
    assert verdict([{"ok": False}, TimeoutError(), "junk"]) is False
    assert verdict([TimeoutError(), {"ok": "yes"}]) is None
    assert verdict([]) is None


async def test_a_node_that_is_dialed_back_announces_its_address_and_a_dial_back_goes_only_to_the_caller(
        hosts) -> None:
    from dht import DHTNode
    from dht.autonat import DIALBACK_METHOD

    async with asyncio.timeout(20):
        public = DHTNode()
        probing = DHTNode(reachable=None)
        try:
            await public.start()
            told = asyncio.Event()  # the push of the port it announces once it knows it is reachable
            public.host.on_connect.append(lambda c: told.set() if c.remote_listen_port else None)
            await probing.start([public.multiaddrs[0]])
            assert probing.host.reachable is True and not probing.multiaddrs[0].is_circuit
            await told.wait()
            learnt = public.routing.get(probing.peer_id)
            assert learnt is not None and learnt.addr == ("127.0.0.1", probing.host.listen_port)
            conn = public.host.connection(probing.peer_id)
            assert conn is not None
            closed = await hosts()
            port = closed.listen_port
            await closed.close()
            # nothing listens there: the answer is no (and the caller cannot name another address)
            assert await conn.call(DIALBACK_METHOD, {"port": port}) == {"ok": False}
            with pytest.raises(RPCError, match="port"):
                await conn.call(DIALBACK_METHOD, {"port": 0, "host": "10.0.0.1"})
        finally:
            await probing.close()
            await public.close()


# ------------------------------------------------------------------------------ network namespaces

try:
    from p2ptrain.testing import Testbed, available
    from p2ptrain.testing.natrouter import available as nat_available
    _OK, _WHY = available()
    if _OK:
        _OK, _WHY = nat_available()
except Exception as e:  # noqa: BLE001 - no test bed module or no Linux: skip with the reason
    _OK, _WHY = False, str(e)

_NODE = r"""
import asyncio, json, sys, time
from dht import DHTNode, Multiaddr, PeerID, RelayService, punch_stats
from dht.relay import relayed_via

async def line():
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

async def main(role, ip, boot):
    node = DHTNode(listen=(ip, 0), reachable=None)  # each finds out (dht.autonat)
    svc = RelayService(node.host) if role == "public" else None
    await node.start([Multiaddr.parse(boot)] if boot else [])
    if svc: svc.start()
    print(json.dumps({"addrs": [str(a) for a in node.multiaddrs], "id": str(node.peer_id)}), flush=True)
    out = {}
    if role == "nat":
        others = json.loads(await line())
        await node.store(f"from {node.peer_id}", ip, time.time() + 60)
        print(json.dumps({"stored": True}), flush=True)
        await line()  # every node has stored
        for peer in others:
            res = await node.get(f"from {peer}", latest=True)
            out[peer] = {"value": res.value if res else None}
        await asyncio.sleep(0)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            conns = {p: node.host.connection(PeerID.from_base58(p)) for p in others}
            if all(c is not None and relayed_via(c) is None for c in conns.values()):
                break
            await asyncio.sleep(0.1)
        for p, c in conns.items():
            out[p]["direct"] = c is not None and relayed_via(c) is None
            out[p]["remote_host"] = c.remote_host if c is not None else None
        contacts = {str(c.peer_id): [c.addr, [str(r) for r in c.relays]] for c in node.routing}
        out["contacts"] = contacts
    print(json.dumps(out), flush=True)
    await line()  # every node is done: the punch counters are final
    print(json.dumps(punch_stats(node.host).as_dict()), flush=True)
    await line()
    await node.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


class _Node:
    def __init__(self, tb: Any, i: int, role: str, boot: str) -> None:
        self.p = tb.popen(i, [sys.executable, "-c", _NODE, role, tb.hosts[i].local_ip, boot],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line(self) -> dict:
        text = self.p.stdout.readline()
        assert text, f"node exited with {self.p.wait()}"
        return json.loads(text)

    def say(self, text: str = "") -> None:
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _OK, reason=f"no NAT test bed here: {_WHY}")
def test_netns_nated_dht_nodes_are_found_through_relays_then_punch_direct_connections(child_pids) -> None:
    """2 public nodes (relays) and 2 behind their own NAT routers: each NAT'd node stores a record
    and reads the other's (lookups reach it through relays), then talks to it directly."""
    before = child_pids()
    with Testbed(4, nat=[2, 3], rate=None) as tb:
        p0 = _Node(tb, 0, "public", "")
        first = p0.line()
        boot = first["addrs"][0]
        nodes = [p0, *(_Node(tb, i, role, boot) for i, role in ((1, "public"), (2, "nat"), (3, "nat")))]
        infos = [first, *(n.line() for n in nodes[1:])]  # started (the NAT'd ones probed and reserved)
        ids = [info["id"] for info in infos]
        nodes[2].say(json.dumps([ids[3]]))
        nodes[3].say(json.dumps([ids[2]]))
        assert nodes[2].line() == nodes[3].line() == {"stored": True}
        for n in nodes[2:]:
            n.say()  # every node has stored: read the other's record
        results = [n.line() for n in nodes]
        stats = []
        for n in nodes:
            n.say()
            stats.append(n.line())
        for n in nodes:
            n.say()
        for n in nodes:
            assert n.p.wait(timeout=30) == 0
    assert not any("/p2p-circuit/" in a for info in infos[:2] for a in info["addrs"])  # found reachable
    for me, other in ((2, 3), (3, 2)):
        # the NAT'd node found it cannot be dialed and announces circuits through relays only
        assert infos[me]["addrs"] and all("/p2p-circuit/" in a for a in infos[me]["addrs"])
        got = results[me][ids[other]]
        assert got["value"] == tb.hosts[other].local_ip  # read the other NAT'd node's record
        assert got["direct"] and got["remote_host"] == tb.hosts[other].ip  # punched, through its router
        addr, relays = results[me]["contacts"][ids[other]]
        assert addr is None and relays  # still known by its circuit addresses (the fallback)
    assert stats[2]["direct"] + stats[3]["direct"] >= 1 and stats[2]["failed"] == stats[3]["failed"] == 0
    assert child_pids() <= before
