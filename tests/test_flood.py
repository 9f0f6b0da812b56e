"""Connection floods on loopback: sockets that never finish a handshake cannot lock real peers out.

Before the handshake caps (``Limits.max_handshakes`` / ``max_handshakes_per_ip``), 1024 silent
sockets filled ``max_connections`` and a new peer was refused (benchmarks/flood.py: 3 of 20 joins
got through). Attackers here connect from 127.0.0.2 and 127.0.0.3 (all of 127/8 is loopback on
Linux), real peers from 127.0.0.1, so the per-address cap can tell them apart.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from dht.identity import Identity
from dht.limits import Limits
from dht.transport import Host

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs 127.0.0.2 (Linux loopback)")]


@pytest.fixture
async def hosts():
    made: list[Host] = []

    async def make(limits: Limits | None = None, listen: tuple[str, int] | None = ("127.0.0.1", 0)) -> Host:
        h = Host(Identity(), listen, limits=limits)
        await h.start()
        h.on_request("echo", lambda _conn, args: _echo(args))
        made.append(h)
        return h

    yield make
    for h in made:
        await h.close()


async def _echo(args):
    return args


class Silent(asyncio.Protocol):
    """A socket that sends nothing and notices when the other side closes it."""

    def __init__(self) -> None:
        self.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def open_silent(port: int, n: int, source: str) -> list[tuple[asyncio.Transport, Silent]]:
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(n):
        out.append(await loop.create_connection(Silent, "127.0.0.1", port, local_addr=(source, 0)))
    return out


async def closed(flood, k: int) -> None:
    """Until at least ``k`` of the silent sockets were closed by the victim."""
    pending = {p.closed for _, p in flood if not p.closed.done()}
    while len(flood) - len(pending) < k:
        _done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)


async def test_silent_sockets_from_one_address_hold_at_most_the_per_ip_cap(hosts) -> None:
    victim = await hosts(Limits(max_handshakes_per_ip=4))
    flood = await open_silent(victim.listen_port, 12, "127.0.0.2")
    try:
        async with asyncio.timeout(5):  # the 8 over the cap are closed by the victim at once
            await closed(flood, 8)
        assert [p.closed.done() for _, p in flood[:4]] == [False] * 4  # the first four wait for their handshake
        assert len(victim._handshaking) == 4
        # a real peer from another address still joins, and calls work
        peer = await hosts(listen=None)
        conn = await peer.connect("127.0.0.1", victim.listen_port, victim.peer_id)
        assert await conn.call("echo", "still here") == "still here"
    finally:
        for t, _ in flood:
            t.close()


async def test_global_handshake_cap_spans_addresses_and_slots_are_released(hosts) -> None:
    victim = await hosts(Limits(max_handshakes=3, max_handshakes_per_ip=2, handshake_timeout=0.5))
    flood = (await open_silent(victim.listen_port, 3, "127.0.0.2")
             + await open_silent(victim.listen_port, 3, "127.0.0.3"))
    try:
        async with asyncio.timeout(5):  # 2 + 1 held (per-IP cap, then the global one); the rest closed
            await closed(flood, 3)
        assert len(victim._handshaking) <= 3
        # the stalled ones run out of handshake time, which frees their slots
        async with asyncio.timeout(5):
            await closed(flood, len(flood))
        assert victim._handshaking == set() and victim._handshakes_per_ip == {}
    finally:
        for t, _ in flood:
            t.close()
    # completed handshakes release their slot too: more peers than the caps join one after another
    peers = [await hosts(listen=None) for _ in range(5)]
    for p in peers:
        conn = await p.connect("127.0.0.1", victim.listen_port, victim.peer_id)
        assert await conn.call("echo", 1) == 1
    assert victim._handshaking == set() and len(victim.connections) == 5


async def test_outbound_dials_are_not_limited_by_the_inbound_caps(hosts) -> None:
    dialer = await hosts(Limits(max_handshakes=1, max_handshakes_per_ip=1))
    targets = [await hosts() for _ in range(4)]
    conns = await asyncio.gather(*(dialer.connect("127.0.0.1", t.listen_port, t.peer_id) for t in targets))
    assert [await c.call("echo", i) for i, c in enumerate(conns)] == [0, 1, 2, 3]
