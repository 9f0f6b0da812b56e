"""Hostile peers: attacks on DHT records, storage, routing and relays (see the package docstring).

Each mode is an ordinary peer of the swarm (valid keys, valid handshakes) doing what the protocol
allows it to try. ``from_address`` makes a host dial from another loopback address, so that a test
on one machine can tell an attacker's address from the honest peers' (Linux routes all of
127.0.0.0/8 to the loopback interface).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgpack

from dht import DHTError, DHTNode, Host, Identity, InvalidRecord, Multiaddr, PeerID

from ._registry import mode

#: the longest TTL a node accepts (DHTConfig.max_ttl is 24 h), less a margin for clock skew
LONGEST_TTL = 86_000.0


class _BoundLoop:
    """The event loop as a host sees it, but dialing from ``ip``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ip: str):
        self._loop, self._ip = loop, ip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def create_connection(self, *args: Any, **kw: Any) -> Any:
        kw.setdefault("local_addr", (self._ip, 0))
        return self._loop.create_connection(*args, **kw)


def from_address(host: Host, ip: str | None) -> Host:
    """Make the started ``host`` dial from ``ip`` (None: leave it as it is)."""
    if ip is not None:
        host.loop = _BoundLoop(host.loop, ip)  # type: ignore[assignment]
    return host


def _record(key: bytes, value: bytes, ttl: float, subkey: bytes | None = None) -> list:
    return [key, subkey, value, time.time() + ttl, None]


# ---------------------------------------------------------------------------------- item 5


@mode("plain_value_poison", "store an unsigned plain value with the longest TTL under a key that holds (or will hold) "
      "owner-signed sub-keys, and serve it to lookups of that key")
async def plain_value_poison(node: DHTNode, key: str | bytes, value: Any = "poison", *, serve: bool = True) -> int:
    """Store ``value`` under ``key`` on the key's k closest peers (how many took it), and when
    ``serve``, answer every ``find_value`` of ``key`` with that record, as a holder that kept it
    (on each call, one more key: every key poisoned so far is served)."""
    kb = key.encode() if isinstance(key, str) else bytes(key)
    expiration = time.time() + LONGEST_TTL
    try:
        accepted = await node.store(kb, value, expiration)
    except InvalidRecord:
        accepted = 0
    if serve:
        _poisoned(node)[kb] = [kb, None, msgpack.packb(value, use_bin_type=True), expiration, None]
    return accepted


_SERVED: weakref.WeakKeyDictionary[DHTNode, dict[bytes, list]] = weakref.WeakKeyDictionary()


def _poisoned(node: DHTNode) -> dict[bytes, list]:
    """The keys ``node`` answers with a poisoned record (its find_value handler, installed once)."""
    if node not in _SERVED:
        wires: dict[bytes, list] = {}
        honest = node._rpc_find_value

        async def find_value(conn: Any, args: Any) -> Any:
            reply = await honest(conn, args)
            key = args[0] if isinstance(args, list) and args else args  # (the key, or [key, bounds...])
            wire = wires.get(key) if isinstance(key, bytes) else None
            return [[wire], reply[1]] if wire is not None else reply

        node.host.on_request("find_value", find_value)
        _SERVED[node] = wires
    return _SERVED[node]


@mode("subkey_squat", "fill a key (say, a future matchmaking round) with unsigned sub-keys on its k closest "
      "peers, so that the owners' sub-keys find no room")
async def subkey_squat(node: DHTNode, key: str | bytes, count: int = 1000) -> int:
    """Store ``count`` unsigned sub-keys under ``key`` on its k closest peers; how many were taken."""
    kb = key.encode() if isinstance(key, str) else bytes(key)
    closest = (await node.lookup_value(kb)).closest
    records = [_record(kb, b"\xa6squat!", LONGEST_TTL, b"squat/%d" % i) for i in range(count)]
    taken = 0
    for contact in closest:
        for start in range(0, count, 256):
            try:
                replies = await node.host.call(contact.peer_id, contact.addr, "store", records[start:start + 256], 10)
            except DHTError:
                break
            taken += sum(1 for r in replies if r is True)
    return taken


# ---------------------------------------------------------------------------------- item 7


@dataclass
class FloodResult:
    accepted: int = 0
    refused: int = 0
    seconds: float = 0.0


@mode("sybil_store_flood", "many fresh identities (from one address) STORE unique keys at one node until each is "
      "refused, to fill its store")
async def sybil_store_flood(target: Multiaddr, *, identities: int = 50, records: int = 2000, value_size: int = 16,
                            source_ip: str | None = None, ttl: float = 3600.0, concurrency: int = 8) -> FloodResult:
    """``identities`` client-mode hosts, each sending up to ``records`` STOREs of unique keys (in
    batches of up to 256 within the 1 MiB message limit, stopping at its first refused batch) to
    the node at ``target``."""
    out, sem, value = FloodResult(), asyncio.Semaphore(concurrency), msgpack.packb(os.urandom(value_size))
    per_call = max(1, min(256, (900 << 10) // (len(value) + 64)))
    t0 = time.monotonic()

    async def one() -> None:
        async with sem:
            host = Host(Identity(), None)
            await host.start()
            try:
                from_address(host, source_ip)
                conn = await host.connect_addr(target, timeout=10)
                prefix = os.urandom(8).hex().encode()
                for start in range(0, records, per_call):
                    end = min(records, start + per_call)
                    batch = [_record(b"flood/%s/%d" % (prefix, j), value, ttl) for j in range(start, end)]
                    replies = await conn.call("store", batch, timeout=30)
                    ok = sum(1 for r in replies if r is True)
                    out.accepted += ok
                    out.refused += len(replies) - ok
                    if ok < len(replies):
                        break
            except DHTError:
                out.refused += 1
            finally:
                await host.close()

    await asyncio.gather(*(one() for _ in range(identities)))
    out.seconds = time.monotonic() - t0
    return out


# ---------------------------------------------------------------------------------- item 8


@contextlib.contextmanager
def blackhole(ip: str = "127.0.0.1") -> Any:
    """An address that accepts TCP connections and never answers: a dial there runs out its timeout."""
    sock = socket.socket()
    try:
        sock.bind((ip, 0))
        sock.listen(64)
        yield sock.getsockname()[:2]
    finally:
        sock.close()


@mode("routing_poison", "answer every find_node/find_value with an honest peer at a bogus address, to overwrite its "
      "address in the asker's routing table and get it evicted when dials there fail")
def routing_poison(node: DHTNode, honest: PeerID, bogus: tuple[str, int]) -> None:
    """From now on ``node`` answers lookups naming ``honest`` at ``bogus`` (and nobody else)."""
    contacts = [[honest.to_bytes(), bogus[0], bogus[1]]]

    async def find_node(conn: Any, args: Any) -> Any:
        return contacts

    async def find_value(conn: Any, args: Any) -> Any:
        return [[], contacts]

    node.host.on_request("find_node", find_node)
    node.host.on_request("find_value", find_value)


# ---------------------------------------------------------------------------------- item 4


@mode("reply_confusion", "answer the lookup of any key with an unsigned record of another key")
def reply_confusion(node: DHTNode, decoy_key: bytes, value: bytes = b"\x81\xa5epoch\xce\x7f\xff\xff\xff") -> None:
    """From now on ``node`` answers every ``find_value`` with a plain record of ``decoy_key``."""
    async def find_value(conn: Any, args: Any) -> Any:
        return [[_record(decoy_key, value, 120.0)], []]

    node.host.on_request("find_value", find_value)


# ---------------------------------------------------------------------------------- item 9


@mode("relay_slot_sybil", "fresh client-mode identities (from one address) each take a reservation at a relay, to "
      "fill every slot")
@contextlib.asynccontextmanager
async def relay_slot_sybil(relay: Multiaddr, count: int, *, source_ip: str | None = None) -> AsyncIterator[list[Host]]:
    """Hold up to ``count`` reservations at ``relay``, one per fresh identity, until the block
    ends; yields the hosts that got one (it stops at the first refusal)."""
    hosts: list[Host] = []
    held: list[Host] = []
    try:
        for _ in range(count):
            host = Host(Identity(), None)
            hosts.append(host)
            await host.start()
            from_address(host, source_ip)
            try:
                await host.reserve_relay(relay)
            except DHTError:
                break
            held.append(host)
        yield held
    finally:
        await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
