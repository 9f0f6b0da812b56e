"""The node's lookups: iterative find_node / find_value over ``routing.Lookup``, reads
(``lookup_value``, ``get``, ``get_owned``, from given holders) and the fan-out of a store to a key's
k closest peers.

``Lookups`` is a part of ``DHTNode`` (``dht.node``); it asks peers through ``_call``, which also
keeps the routing table told of who answered and who failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from .config import DHTConfig
from .connection import Connection
from .errors import DHTError, InvalidRecord, ProtocolError, RPCError
from .identity import PeerID
from .latency import RttEstimator, Stragglers
from .owned import OwnedRead, owned_values
from .protocol import decode_contacts, store_request, value_request
from .routing import Contact, Lookup, RoutingTable, key_id
from .storage import Record, RecordStore, VerifiedOwners, merge_records, validate_record
from .tasks import TaskGroup
from .transport import Host
from .wire import unpack

log = logging.getLogger("dht.node")

MAX_REPLY_RECORDS = 1000  # records taken from one find_value reply


class ValueWithExpiration(NamedTuple):
    value: Any
    expiration: float


@dataclass
class LookupResult:
    """What a value lookup found, and how: ``hops`` is the depth of the first peer that had it."""

    records: list[Record]
    hops: int = 0
    queried: int = 0
    closest: list[Contact] = field(default_factory=list)


def _late_outcome(task: asyncio.Task) -> None:
    """Read the outcome of a query its lookup stopped waiting for; only a bug is worth a log line."""
    if not task.cancelled() and not isinstance(exc := task.exception(), (DHTError, type(None))):
        log.error("a late lookup query failed", exc_info=exc)


def key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


class Lookups:
    """Iterative lookups, reads and replication of ``DHTNode``."""

    config: DHTConfig
    host: Host
    peer_id: PeerID
    routing: RoutingTable
    storage: RecordStore
    _verified: VerifiedOwners
    _learn: Callable[[Connection], None]
    _tasks: TaskGroup
    _rtt: RttEstimator
    _watch_at: Callable[[bytes, list[Contact], float], None]

    async def _request(self, contact: Contact, method: str, args: Any, timeout: float) -> Any:
        """One RPC; a find_value in ``value_request``'s filtered form, or a store asking for a
        notice, that the peer refuses (an older version) is asked again in the plain form."""
        try:
            return await self.host.call(contact.peer_id, contact.addr, method, args, timeout, relays=contact.relays)
        except RPCError:
            if method == "find_value" and isinstance(args, list):
                args = args[0]
            elif method == "store" and isinstance(args, dict):  # (asked for a notice)
                args = args["r"]
            else:
                raise
        return await self.host.call(contact.peer_id, contact.addr, method, args, timeout, relays=contact.relays)

    async def _call(self, contact: Contact, method: str, args: Any) -> Any:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            result = await self._request(contact, method, args, self.config.rpc_timeout)
        except DHTError:
            self.routing.mark_failed(contact.peer_id, contact.addr)
            raise
        self._rtt.observe(contact.peer_id, loop.time() - t0)
        conn = self.host.connection(contact.peer_id)
        if conn is not None:  # its address as the connection shows it, not as whoever named it said
            self._learn(conn)
        return result

    async def _run_lookup(self, target: int, method: str, arg: bytes, want_records: bool,
                          latest: bool) -> LookupResult:
        cfg = self.config
        window = cfg.read_window if latest else cfg.k
        lookup = Lookup(target, self.routing.closest(target, cfg.k), window, cfg.alpha, own_peer=self.peer_id,
                        wide=latest)
        result = LookupResult(records=[])
        if want_records:
            local = self.storage.get(arg, time.time())
            if local:
                result.records.extend(local)
                if not latest:
                    return result
        pending: dict[asyncio.Task, Contact] = {}
        # Queries not yet past their adaptive timeout -> when they will be. One past it leaves the
        # lookup's window (the next contact is asked instead) but its reply still counts if it
        # comes before the lookup ends: a slow peer costs a hedge, not its full RPC timeout.
        # latest, which asks its whole window (its read quorum) at once (``Lookup.wide``), also
        # leaves behind a query far slower than the others once half of them answered
        # (``Stragglers``): one stalled peer cannot hold up the whole lookup.
        due: dict[asyncio.Task, float] = {}
        sent: dict[asyncio.Task, float] = {}
        stragglers = Stragglers(window) if latest else None
        loop = asyncio.get_running_loop()
        found_from = 0
        try:
            while True:
                queries = lookup.next_queries()
                radius = lookup.radius() if want_records and queries else None
                args = arg if radius is None else value_request(arg, radius, lookup.window_ids())
                for contact in queries:
                    if self._tasks.closed:  # a closed node reaches no one
                        lookup.on_failure(contact)
                    else:
                        task = self._tasks.spawn(self._call(contact, method, args), awaited=True)
                        pending[task] = contact
                        sent[task] = loop.time()
                        due[task] = sent[task] + self._rtt.timeout(contact.peer_id)
                if not pending or lookup.finished:
                    break
                cutoff = stragglers.cutoff() if stragglers else None
                until = due if cutoff is None else {t: min(at, sent[t] + cutoff) for t, at in due.items()}
                wait = max(0.0, min(until.values()) - loop.time()) if until else None
                done, _ = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                now = loop.time()
                for task in [t for t, at in until.items() if at <= now and t not in done]:
                    if due.pop(task) <= now:
                        self._rtt.timed_out(pending[task].peer_id)
                    lookup.on_timeout(pending[task], replace=not latest)
                for task in done:
                    contact = pending.pop(task)
                    due.pop(task, None)
                    took = now - sent.pop(task)
                    try:
                        reply = task.result()
                        if stragglers:
                            stragglers.answered(took)
                        if want_records:
                            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], list)):
                                raise ProtocolError("malformed find_value reply")
                            records = self._valid_records(reply[0][:MAX_REPLY_RECORDS], arg)
                            found = decode_contacts(reply[1], self.config.k)
                            if records:
                                result.records.extend(records)
                                found_from += 1
                                result.hops = result.hops or lookup.depth(contact)
                        else:
                            found = decode_contacts(reply, self.config.k)
                        lookup.on_response(contact, self.routing.vouched(found))
                    except (DHTError, InvalidRecord) as e:
                        if isinstance(e, (ProtocolError, InvalidRecord)):
                            log.debug("bad reply from %s: %s", contact.peer_id, e)
                        lookup.on_failure(contact)
                if want_records and found_from and not latest:
                    lookup.stop()
        finally:
            for task in pending:
                if task in due:
                    task.cancel()
                else:  # a late query runs on: its failure still counts against the peer
                    task.add_done_callback(_late_outcome)
        result.closest = lookup.result()
        result.queried = lookup.queried
        self.routing.touch(target, time.monotonic(), result.closest)
        return result

    def _valid_records(self, wire: list, key: bytes) -> list[Record]:
        """Records of ``key`` from a peer's reply that pass the same checks a storing node applies.
        A forged record must not shadow a genuine one just because it claims a later expiration,
        and a record of another key (an unsigned one, say, answering a lookup of an owned key) is
        no answer at all."""
        now, out = time.time(), []
        st = self.storage
        for item in wire:
            try:
                record = Record.from_wire(item)
                validate_record(record, now, st.max_value_size, st.max_key_size, st.max_ttl, self._verified)
            except InvalidRecord:
                continue
            if record.key != key:
                log.debug("dropped a reply record of key %r in a lookup of %r", record.key[:64], key[:64])
                continue
            out.append(record)
        return out

    async def _lookup_nodes(self, target: int) -> list[Contact]:
        return (await self._run_lookup(target, "find_node", target.to_bytes(32, "big"), False, False)).closest

    async def find_peers(self, target: int) -> list[Contact]:
        """The k contacts closest to ``target`` (a 256-bit id) that answered."""
        return await self._lookup_nodes(target)

    async def _replicate(self, records: list[Record], closest: list[Contact] | None = None,
                         notice: int | None = None) -> int:
        """Send records (all under one key) to the k closest peers (looked up unless given) and
        keep a local copy; ``notice``: the holders tell the key's watchers (``dht.watchers``)."""
        key = records[0].key
        accepted = 0
        try:
            if all(self.storage.store(r, time.time()) for r in records):
                accepted += 1
        except InvalidRecord:
            pass
        if closest is None:
            closest = await self._lookup_nodes(key_id(key))
        else:
            closest = [c for c in closest if c.peer_id != self.peer_id and c.dialable][: self.config.k]
        wire = store_request([r.to_wire() for r in records], notice)

        async def send(contact: Contact) -> bool:
            try:
                reply = await self._call(contact, "store", wire)
                return isinstance(reply, list) and any(x is True for x in reply)
            except DHTError:
                return False

        results = await asyncio.gather(*(send(c) for c in closest))
        return accepted + sum(results)

    @staticmethod
    def nearest(key: str | bytes, contacts: Iterable[Contact], n: int) -> list[Contact]:
        """The ``n`` of ``contacts`` (one per peer) nearest ``key``: a key's holders, of those known.
        A lookup under load may return farther ones (the nearest were slow to answer); merged with
        the holders found before, the nearest that answered once stay until one fails."""
        target = key_id(key_bytes(key))
        unique = {c.peer_id: c for c in contacts}
        return sorted(unique.values(), key=lambda c: c.node_id ^ target)[:n]

    async def lookup_value(self, key: str | bytes, latest: bool = False) -> LookupResult:
        """Find records under ``key``. ``latest=False`` stops at the first peer that has some;
        ``latest=True`` asks the nearest ``config.read_window`` of the key's k closest peers at once
        and merges their records (freshest value per sub-key), leaving behind, once half of them
        answered, one far slower than the others (``dht.latency``). ``closest``: those that answered."""
        kb = key_bytes(key)
        result = await self._run_lookup(key_id(kb), "find_value", kb, True, latest)
        now = time.time()
        result.records = [r for r in merge_records(result.records) if r.expiration > now]
        return result

    async def _read_from(self, key: bytes, holders: list[Contact], timeout: float,
                         watch: float = 0.0) -> LookupResult:
        """The records of ``key`` that ``holders`` (one RPC each asking for no contacts, no lookup)
        and this node hold; ``closest``: the holders that answered. Unmerged: a peer's newest is
        chosen by the caller. ``watch``: they tell us of noticed writes for that many seconds."""
        if watch > 0:
            self._watch_at(key, holders, watch)

        async def ask(contact: Contact) -> list[Record]:
            reply = await self._request(contact, "find_value", value_request(key, 0, watch=watch), timeout)
            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], list)):
                raise ProtocolError("malformed find_value reply")
            return self._valid_records(reply[0][:MAX_REPLY_RECORDS], key)

        replies = await asyncio.gather(*(ask(c) for c in holders), return_exceptions=True)
        result = LookupResult(records=self.storage.get(key, time.time()), queried=len(holders))
        for contact, reply in zip(holders, replies):
            if isinstance(reply, list):
                result.records.extend(reply)
                result.closest.append(contact)
            elif not isinstance(reply, (DHTError, InvalidRecord)):
                raise reply
        return result

    async def get_owned(self, key: str | bytes, name: str, *, max_size: int | None = None,
                        holders: list[Contact] | None = None, timeout: float | None = None,
                        watch: float = 0.0) -> OwnedRead:
        """Each peer's value under its own ``name`` sub-key of ``key`` (written with ``store_owned``),
        its signature checked: one value per peer, values over ``max_size`` bytes left out.

        Looks the key up (a latest read, ``lookup_value``), or with ``holders`` (say, a previous read's
        ``closest``) asks only those, one RPC each within ``timeout`` (default: ``rpc_timeout``);
        ``closest`` is then the holders that answered; ``watch``: for that many seconds they tell us
        of writes that ask for a notice (``DHTNode.notices``)."""
        kb = key_bytes(key)
        if holders:
            result = await self._read_from(kb, holders, self.config.rpc_timeout if timeout is None else timeout,
                                           watch)
        else:
            result = await self.lookup_value(kb, latest=True)
        limit = self.storage.max_value_size if max_size is None else max_size
        return OwnedRead(owned_values(result.records, name, self._verified, limit), result.closest)

    async def get(self, key: str | bytes,
                  latest: bool = False) -> ValueWithExpiration | dict[str, ValueWithExpiration] | None:
        """The value under ``key``: a ValueWithExpiration, a dict sub-key -> ValueWithExpiration,
        or None when nothing unexpired is found. Values that fail to decode are skipped."""
        result = await self.lookup_value(key, latest)
        return self.decode(result.records)

    @staticmethod
    def decode(records: list[Record]) -> ValueWithExpiration | dict[str, ValueWithExpiration] | None:
        if not records:
            return None
        if len(records) == 1 and records[0].subkey is None:
            r = records[0]
            try:
                return ValueWithExpiration(unpack(r.value), r.expiration)
            except ProtocolError:
                return None
        out: dict[str, ValueWithExpiration] = {}
        for r in records:
            if r.subkey is None:
                continue
            try:
                out[r.subkey.decode(errors="replace")] = ValueWithExpiration(unpack(r.value), r.expiration)
            except ProtocolError:
                continue
        return out
