"""The DHT board of a matchmaking round: our owner-signed entry under the round's key (and our schema
summary under the round's schemas key), and validated reads of everyone else's entries."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from dht import Contact, DHTError, DHTNode, OwnedValue, PeerID

from .claims import VERSION as _VERSION
from .claims import Entry, parse_entry
from .group import Member
from .mm_state import MatchRound
from .schema import Schema, parse_summary, schema_mismatch_message

log = logging.getLogger("p2ptrain.matchmaking")

_MEMBER_SUBKEY = "m"
_MAX_ENTRY_BYTES = 4096
_MAX_SUMMARY_BYTES = 16 * 1024
_LINGER = 2.0  # s: our entry outlives our deadline by this much
_READ_FANOUT = 2  # holders asked per poll once a full lookup has found them
_MIN_LIVE_HOLDERS = 3  # fewer left answering: look the key up again (dead holders replaced)
_HOLDERS = 8  # a round's entries go to its key's closest few, so a round's cost does not grow with the swarm
_TRUST_AFTER = 2  # lookups in a row that found the holders our table named: skip the next ones...
_CHECK_EVERY = 8  # ...except one round in this many, which checks the table is still right
_SUMMARY_HOLDERS = 3  # schema summaries: written to and read from the key's closest three


class Board:
    """Registers this peer for rounds and reads who else did, for one run (``prefix``) and schema.

    Background writes go through ``spawn`` (the matchmaker owns those tasks); ``latency`` is an
    EWMA of the DHT read time, ``mismatches()`` explains peers registered with another schema.
    """

    def __init__(self, node: DHTNode, prefix: str, schema: Schema,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task]):
        self.node = node
        self.prefix = prefix
        self.schema = schema
        self._spawn = spawn
        self._mismatches: dict[str, str] = {}
        self._latency: float | None = None  # EWMA of DHT read latency, seconds
        self._agreed = 0  # full lookups in a row whose holders our routing table had named
        self._skipped = 0  # registrations since the last full lookup
        self.closed = False

    @property
    def latency(self) -> float:
        return self._latency if self._latency is not None else 0.02

    @property
    def measured_latency(self) -> float | None:
        """The EWMA of DHT read latency, None before the first read."""
        return self._latency

    def round_key(self, round_id: str | int) -> str:
        return f"{self.prefix}/avg/{self.schema.hash}/{round_id}"

    def schemas_key(self, round_id: str | int) -> str:
        return f"{self.prefix}/avg/schemas/{round_id}"

    def mismatches(self) -> dict[str, str]:
        """Peer id (base58) -> a sentence explaining how its schema differs from ours."""
        return dict(self._mismatches)

    def register(self, rnd: MatchRound, me: Member, timeout: float, deadline: float) -> None:
        """Write our entry for the round, in the background, at once to the key's holders as our
        routing table knows them (it lands half a round trip later), and to any others a full
        lookup of the key then finds (skipped while recent lookups found what the table named).
        Gathering does not wait for it: we count ourselves in any case, and the others see us once
        it lands."""
        now_wall = time.time()
        rnd.entry_value = {"v": _VERSION, "m": me.to_wire(), "t": now_wall, "w": float(timeout), "d": False}
        rnd.entry_expiration = now_wall + timeout + _LINGER
        known = self.node.nearest_known(rnd.key)
        rnd.holders = known[:_HOLDERS]
        # The schema summary only explains mismatches: publish it without waiting for it.
        self._spawn(self._publish_summary(rnd))
        self._spawn(self._store_entry(rnd, deadline))
        holders = {c.peer_id for c in rnd.holders}
        if mates := [c for c in rnd.mates if c.peer_id not in holders]:
            self._spawn(self._store_at(rnd, mates, deadline))
        # We know fewer peers than a key has holders: each is one (and writes to us if it knows us),
        # and a lookup would ask them only. Nor is one needed while recent lookups found the
        # holders our table named (a lookup asks ~k peers: most of a round's RPCs in a large swarm).
        if len(rnd.holders) < _HOLDERS or self._table_trusted():
            rnd.looked_up.set()
        else:
            self._skipped = 0
            self._spawn(self._look_up_holders(rnd, deadline, {c.peer_id for c in known}))

    def _table_trusted(self) -> bool:
        """Whether this registration may skip its full lookup (counted as skipped if so)."""
        if self._agreed < _TRUST_AFTER or self._skipped + 1 >= _CHECK_EVERY:
            return False
        self._skipped += 1
        return True

    async def _store_entry(self, rnd: MatchRound, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent: set[PeerID] = set()
        try:
            async with asyncio.timeout_at(deadline):
                if rnd.holders:
                    sent = {c.peer_id for c in rnd.holders}
                    await self._store(rnd, rnd.holders)
                    rnd.mark("registered")
                await rnd.looked_up.wait()
                missed = [c for c in rnd.holders if c.peer_id not in sent]
                if rnd.state == "done" or (sent and not missed):
                    return  # (a round over before the lookup: mark_done writes what is left)
                await self._store(rnd, missed or None)
            log.debug("round %s: registered in %.3f s", rnd.round_id, loop.time() - t0)
        except TimeoutError:
            return
        except DHTError as e:
            log.warning("could not register for round %s: %s", rnd.round_id, e)

    async def _store_at(self, rnd: MatchRound, mates: list[Contact], deadline: float) -> None:
        """Our entry straight to the peers expected in our group (not holders of the key): it shows
        in their nodes' ``local`` view half a round trip after it left, without a read."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._store(rnd, mates)
        except (TimeoutError, DHTError):
            pass

    async def _store(self, rnd: MatchRound, holders: list[Contact] | None) -> None:
        assert rnd.entry_value is not None
        await self.node.store_owned(rnd.key, _MEMBER_SUBKEY, rnd.entry_value, rnd.entry_expiration, closest=holders)

    async def _look_up_holders(self, rnd: MatchRound, deadline: float, known: set[PeerID]) -> None:
        """The key's holders by a full lookup: the routing table's guess misses some in a large
        swarm. Whether our table already knew every holder found (``known``: its k nearest the key)
        decides whether the next rounds trust it (a slow holder the lookup passed over is no miss)."""
        try:
            async with asyncio.timeout_at(deadline):
                read = await self.node.get_owned(rnd.key, _MEMBER_SUBKEY, max_size=_MAX_ENTRY_BYTES)
            found = [c for c in read.closest if c.addr is not None][:_HOLDERS]
            if found:  # (with those our table named: a loaded holder may answer the lookup too late)
                rnd.holders = self.node.nearest(rnd.key, [*found, *rnd.holders], _HOLDERS)
            # (a loaded swarm's lookup may end before a slow holder or two answered: no miss)
            agreed = len(found) >= _HOLDERS - 2 and all(c.peer_id in known for c in found)
            self._agreed = self._agreed + 1 if agreed else 0
        except (TimeoutError, DHTError):
            self._agreed = 0
        finally:
            rnd.looked_up.set()

    async def _publish_summary(self, rnd: MatchRound) -> None:
        try:
            key = self.schemas_key(rnd.round_id)
            await self.node.store_owned(key, _MEMBER_SUBKEY, self.schema.summary(), rnd.entry_expiration,
                                        closest=self.node.nearest_known(key)[:_SUMMARY_HOLDERS] or None)
        except DHTError as e:
            log.debug("could not publish our schema summary for round %s: %s", rnd.round_id, e)

    async def mark_done(self, rnd: MatchRound) -> None:
        """Tell peers still gathering that we are no longer a candidate (best effort)."""
        if rnd.entry_value is None or self.closed:
            return
        value = dict(rnd.entry_value, d=True)
        rnd.entry_expiration = max(rnd.entry_expiration, time.time() + 1.0) + 0.001
        try:  # to the holders the round found (no lookup of its own), else a full store
            await self.node.store_owned(rnd.key, _MEMBER_SUBKEY, value, rnd.entry_expiration,
                                        closest=rnd.holders or None)
        except DHTError:
            pass

    async def _entries(self, key: str, holders: list[Contact], fanout: int,
                       deadline: float) -> tuple[dict[PeerID, OwnedValue], list[Contact] | None, set[PeerID]]:
        """Each peer's entry under ``key`` (signature checked); the holders a full lookup found
        (None without one) and those that did not answer.

        With no ``holders`` known this is a full DHT lookup. Otherwise we ask ``fanout`` of them,
        chosen at random, directly: every registration is replicated to all of them, so a few
        suffice, and a poll costs 3 RPCs instead of a lookup over the k closest (which overloads
        the holders when many peers poll).
        """
        if not holders:
            read = await self.node.get_owned(key, _MEMBER_SUBKEY, max_size=_MAX_ENTRY_BYTES)
            return read.values, [c for c in read.closest if c.addr is not None][:_HOLDERS], set()
        chosen = random.sample(holders, min(fanout, len(holders)))
        timeout = max(0.01, min(self.node.config.rpc_timeout, deadline - asyncio.get_running_loop().time()))
        read = await self.node.get_owned(key, _MEMBER_SUBKEY, max_size=_MAX_ENTRY_BYTES, holders=chosen,
                                         timeout=timeout)
        return read.values, None, {c.peer_id for c in chosen} - {c.peer_id for c in read.closest}

    def local(self, rnd: MatchRound) -> dict[PeerID, Entry]:
        """The entries our own node holds (no RPC): on a holder of the round's key (every peer of a
        small swarm), a peer's entry shows here as soon as its write lands."""
        values = self.node.local_owned(rnd.key, _MEMBER_SUBKEY, max_size=_MAX_ENTRY_BYTES)
        return _parsed(values)

    async def registered(self, rnd: MatchRound, deadline: float) -> dict[PeerID, Member]:
        return {p: e.member for p, e in (await self.read(rnd, deadline)).items()}

    async def read(self, rnd: MatchRound, deadline: float) -> dict[PeerID, Entry]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # the first read asks every holder we know: our entry and the others' land there meanwhile
        fanout = len(rnd.holders) if rnd.reads == 0 else _READ_FANOUT
        rnd.reads += 1
        try:
            async with asyncio.timeout_at(deadline):
                values, found, dead = await self._entries(rnd.key, rnd.holders, fanout, deadline)
        except (TimeoutError, DHTError):
            rnd.holders = []
            return {}
        # (reads overlap: drop the dead from the current list, which another read may have renewed)
        live = [c for c in rnd.holders if c.peer_id not in dead]
        if found is None and dead and len(live) < _MIN_LIVE_HOLDERS:
            live = []  # too few left answering: the next read looks the key up again
        rnd.holders = found if found is not None else live
        elapsed = loop.time() - t0
        self._latency = elapsed if self._latency is None else 0.7 * self._latency + 0.3 * elapsed
        return _parsed(values)

    async def check_schemas(self, rnd: MatchRound, deadline: float) -> None:
        """Explain (once per peer) why peers registered for this round are not candidates."""
        key = self.schemas_key(rnd.round_id)
        # the holders the summaries were written to (see _publish_summary), not a lookup
        try:
            async with asyncio.timeout_at(deadline):
                read = await self.node.get_owned(key, _MEMBER_SUBKEY, max_size=_MAX_SUMMARY_BYTES,
                                                 holders=self.node.nearest_known(key)[:_SUMMARY_HOLDERS] or None)
        except (TimeoutError, DHTError):
            return
        for owner, got in read.values.items():
            if owner == self.node.peer_id or str(owner) in self._mismatches:
                continue
            summary = parse_summary(got.value)
            if summary is None or summary["hash"] == self.schema.hash:
                continue
            message = schema_mismatch_message(self.schema, got.value, peer=str(owner), run=self.prefix)
            if len(self._mismatches) < 1000:
                self._mismatches[str(owner)] = message
                log.warning("%s", message)


def _parsed(values: dict[PeerID, OwnedValue]) -> dict[PeerID, Entry]:
    entries = ((peer, parse_entry(got.value, peer)) for peer, got in values.items())
    return {peer: entry for peer, entry in entries if entry is not None}
