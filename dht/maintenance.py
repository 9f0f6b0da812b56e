"""The node's upkeep: the routing table (learning contacts, liveness pings of full buckets, bucket
refresh), republishing records, and the on-disk peer cache, run every ``maintenance_period``.

``Maintenance`` is a part of ``DHTNode`` (``dht.node``), which starts ``_maintain`` once joined and
cancels it on close.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Container, Iterable
from pathlib import Path
from typing import Any, Callable, Coroutine

from .config import DHTConfig
from .connection import Connection
from .errors import DHTError
from .identity import PeerID
from .multiaddr import Multiaddr
from .peercache import cache_entries, save_peer_cache
from .routing import Contact, RoutingTable
from .storage import Record, RecordStore
from .tasks import TaskGroup
from .transport import Host

log = logging.getLogger("dht.node")


def republish_batches(originated: dict[tuple[bytes, bytes | None], Record], stored: Iterable[Record],
                      skip: Container[bytes], now: float, force: bool = False) -> list[list[Record]]:
    """What one republish round replicates, a key's records at most 256 to a batch (one store RPC):
    what we wrote ourselves, even if our store dropped it, and the live stored records of keys not
    in ``skip`` (a peer replicated them to us lately) unless ``force``."""
    chosen: dict[tuple[bytes, bytes | None], Record] = dict(originated)
    for rec in stored:
        if rec.expiration > now and (force or rec.key not in skip):
            chosen.setdefault((rec.key, rec.subkey), rec)
    by_key: dict[bytes, list[Record]] = {}
    for rec in chosen.values():
        by_key.setdefault(rec.key, []).append(rec)
    return [rs[i : i + 256] for rs in by_key.values() for i in range(0, len(rs), 256)]


class Maintenance:
    """Routing-table upkeep, republishing and the peer cache of ``DHTNode``."""

    config: DHTConfig
    host: Host
    peer_id: PeerID
    routing: RoutingTable
    storage: RecordStore
    _rng: random.Random
    _originated: dict[tuple[bytes, bytes | None], Record]
    _received_at: dict[bytes, float]  # key -> when a peer last replicated it to us
    _next_republish: float
    _republish_started: float  # monotonic time our last republish round began
    _cache_saved: set[str]
    _cache_saved_at: float | None
    _cache_warned: bool
    _tasks: TaskGroup
    _lookup_nodes: Callable[[int], Coroutine[Any, Any, list[Contact]]]
    _replicate: Callable[..., Coroutine[Any, Any, int]]
    _reserve_relays: Callable[..., Coroutine[Any, Any, None]]

    # ------------------------------------------------------------------ routing table

    def _learn(self, conn: Connection) -> None:
        """Add the peer behind ``conn`` to the routing table if it can be reached: at its listen port
        (a direct connection) or through the relays it announced."""
        if conn.remote_peer is None:
            return
        direct = conn.remote_host is not None and conn.remote_listen_port is not None
        contact = Contact(conn.remote_peer, (conn.remote_host, conn.remote_listen_port) if direct else None,
                          relays=conn.remote_relays)
        if contact.dialable:
            self._add_contact(contact)

    def _add_contact(self, contact: Contact) -> None:
        if contact.peer_id == self.peer_id:
            return
        stale = self.routing.update(contact, time.monotonic())
        if stale is not None and not self._tasks.closed:  # (a closed node checks no one)
            self._tasks.spawn(self._check_liveness(stale))

    async def _check_liveness(self, contact: Contact) -> None:
        """A full bucket met a new peer: keep the old one if it still answers (Kademlia favours
        long-lived peers), else evict it and let the newcomer in from the replacement cache."""
        try:
            await self.host.call(contact.peer_id, contact.addr, "ping", None, self.config.rpc_timeout,
                                 relays=contact.relays)
            self.routing.update(contact, time.monotonic())
        except DHTError:
            self.routing.remove(contact.peer_id)

    # ------------------------------------------------------------------ periodic work

    async def _maintain(self) -> None:
        # The first tick refreshes every bucket (they start untouched), filling the far ones.
        while True:
            await asyncio.sleep(self.config.maintenance_period)
            try:
                self.storage.remove_expired(time.time())
                await self._refresh()
                if self.host.reachable is False and not self.host.client_mode:
                    await self._reserve_relays(lookup=False)  # replace a relay we lost
                await self._refresh_peer_cache()
                if time.monotonic() >= self._next_republish:
                    await self.republish()
                    # Timed from the end of the round: an overrunning round never runs back to back.
                    self._next_republish = time.monotonic() + self._jittered(self.config.republish_interval)
            except asyncio.CancelledError:
                raise
            except Exception:  # maintenance must survive anything a peer did to us
                log.exception("DHT maintenance failed; retrying next period")

    async def _refresh(self) -> None:
        targets = self.routing.buckets_to_refresh(time.monotonic(), self.config.refresh_interval, self._rng)
        await asyncio.gather(*(self._lookup_nodes(t) for t in targets), return_exceptions=True)

    def _jittered(self, period: float) -> float:
        """Spread periodic work so a swarm started at once does not republish in lockstep."""
        return period * self._rng.uniform(0.75, 1.25)

    async def republish(self, force: bool = False) -> None:
        """Re-replicate what we hold, so records survive the death of the peers that stored them.

        As in the Kademlia paper, a key that another peer replicated to us within the last period
        is skipped: that peer has just sent it to the other k-1 closest too, so each key is
        republished by about one holder per period instead of by all k of them.
        """
        now, started = time.time(), time.monotonic()
        # Skipped: keys received since our previous round began (or within a period), so that a round
        # that overran its period under load does not make every holder republish every key.
        recent = min(started - self.config.republish_interval, self._republish_started)
        self._republish_started = started
        self._received_at = {k: t for k, t in self._received_at.items() if t > recent}
        for name, rec in list(self._originated.items()):
            if rec.expiration <= now:
                del self._originated[name]
        batches = republish_batches(self._originated, self.storage.records(), self._received_at, now, force)
        sem = asyncio.Semaphore(8)

        async def one(records: list[Record]) -> None:
            async with sem:
                try:
                    await self._replicate(records)
                except DHTError:
                    pass

        await asyncio.gather(*(one(batch) for batch in batches))

    # ------------------------------------------------------------------ peer cache

    @property
    def _peer_cache(self) -> Path | None:
        pc = self.config.peer_cache
        return None if pc is None else Path(pc).expanduser()

    def peer_cache_entries(self) -> list[Multiaddr]:
        """What the peer cache would hold now: listening peers that answered, newest first."""
        return cache_entries(self.routing, self.peer_id, self.config.peer_cache_size)

    def save_peer_cache(self) -> bool:
        """Write the peer cache now (atomically); False when there is none, nothing to save (an
        empty table never overwrites a useful cache), or it could not be written (one warning)."""
        entries = self.peer_cache_entries()
        return self._write_peer_cache(entries) if entries else False

    def _write_peer_cache(self, entries: list[Multiaddr]) -> bool:
        """The file write alone, safe in a worker thread (``entries`` were read on the loop)."""
        path = self._peer_cache
        if path is None:
            return False
        try:
            save_peer_cache(path, entries, self.config.peer_cache_size)
        except OSError as e:
            if not self._cache_warned:
                self._cache_warned = True
                log.warning("cannot write the peer cache %s (%s); continuing without it", path, e.strerror or e)
            return False
        self._cache_saved = {str(a) for a in entries}
        self._cache_saved_at = time.monotonic()
        return True

    async def _refresh_peer_cache(self) -> None:
        """Rewrite the cache when its peers changed, at most every ``peer_cache_interval`` (the
        first time right after joining: a peer SIGKILLed early still leaves a useful cache). The
        write (with its fsync) runs in a thread so that a slow disk never stalls the node."""
        if self._peer_cache is None:
            return
        if self._cache_saved_at is not None and \
                time.monotonic() - self._cache_saved_at < self.config.peer_cache_interval:
            return
        entries = self.peer_cache_entries()
        if entries and {str(a) for a in entries} != self._cache_saved:
            await asyncio.to_thread(self._write_peer_cache, entries)
