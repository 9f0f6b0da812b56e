"""DHTNode: a Kademlia peer — bootstrap, iterative lookups, store/get, replication, liveness.

This is the asyncio shell around the sans-IO pieces: ``routing.RoutingTable`` and ``routing.Lookup``
decide whom to ask, ``storage.RecordStore`` decides what to keep, ``transport.Host`` moves bytes.
Every background task (maintenance, liveness pings, republish) is owned by the node and cancelled by
``close()``.

Values are any msgpack-able object. A key holds either one value or a dictionary of sub-keys, each
with its own expiration (used for group matchmaking and progress reports). Keys and sub-keys that
contain ``[owner:<PeerID>]`` (see ``DHTNode.owned``) can only be written by that peer: every node
checks the signature before storing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from .aio import cancel_all
from .bootstrap import DialPlan
from .errors import BootstrapError, DHTError, InvalidRecord, PeerIdMismatch, PeerUnreachable, ProtocolError
from .identity import Identity, PeerID
from .multiaddr import Multiaddr
from .noise import SwarmKeyMismatch
from .peercache import MAX_PEERS, cache_entries, load_peer_cache, save_peer_cache
from .quota import address_group
from .relay import relayed_via
from .routing import Contact, Lookup, RoutingTable, key_id, node_id_of
from .storage import Record, RecordStore, merge_records, owned_name, owner_of, sign_record, validate_record
from .swarmkey import SwarmKey
from .transport import Connection, Host, Limits
from .wire import MAX_MESSAGE, pack, unpack

log = logging.getLogger("dht.node")

#: bytes of records one find_value reply may carry: the rest of the 1 MiB message is for contacts
_REPLY_RECORD_BUDGET = MAX_MESSAGE - 64 * 1024


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


@dataclass
class DHTConfig:
    k: int = 20
    alpha: int = 3
    rpc_timeout: float = 2.0
    bootstrap_timeout: float = 10.0
    refresh_interval: float = 600.0  # buckets not looked up for this long get a random lookup
    republish_interval: float = 600.0  # stored records are re-replicated to the k closest this often
    maintenance_period: float = 5.0
    max_value_size: int = 64 * 1024
    max_records: int = 100_000
    max_records_per_source: int = 2_000
    #: bytes the store may hold (records' sizes plus ``quota.RECORD_OVERHEAD`` each), in all and
    #: per source peer; when full, who loses what is decided per address group (``dht.quota``)
    max_bytes: int = 128 << 20
    max_bytes_per_source: int = 16 << 20
    max_ttl: float = 86_400.0
    #: a file where the node keeps the addresses of peers it recently talked to (see
    #: ``dht.peercache``), dialed when every bootstrap address fails; None (the default): no cache
    peer_cache: str | Path | None = None
    peer_cache_size: int = MAX_PEERS
    peer_cache_interval: float = 30.0  # at most one rewrite this often (and one on close)


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def _encode_contacts(contacts: Iterable[Contact]) -> list:
    return [[c.peer_id.to_bytes(), c.addr[0], c.addr[1]] for c in contacts if c.addr is not None]


def _decode_contacts(obj: Any, limit: int) -> list[Contact]:
    if not isinstance(obj, list):
        raise ProtocolError("malformed peer list")
    out = []
    for item in obj[:limit]:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], str) and isinstance(item[2], int)):
            raise ProtocolError("malformed peer entry")
        if not (0 < item[2] < 65536) or len(item[1]) > 255:
            raise ProtocolError("malformed peer address")
        try:
            peer = PeerID(item[0])
        except (ValueError, TypeError):
            raise ProtocolError("malformed peer id") from None
        out.append(Contact(peer, (item[1], item[2])))
    return out


def _wire_size(record: Record) -> int:
    return len(record.key) + len(record.subkey or b"") + len(record.value) + len(record.signature or b"") + 32


def _within_reply_budget(records: list[Record]) -> list[Record]:
    """The records of one key that fit a find_value reply. Every record is small enough alone, but
    a key may hold up to 1000 sub-keys of 64 KiB: replying with all of them would exceed the
    message limit and the reader would drop the connection, so one writer of big sub-keys could make
    the key unreadable for everyone. Past the budget, the smallest records are kept: matchmaking
    and progress entries are small, so padding a key with big values only crowds out the padding."""
    total = sum(_wire_size(r) for r in records)
    if total <= _REPLY_RECORD_BUDGET:
        return records
    out, used = [], 0
    for r in sorted(records, key=lambda r: (_wire_size(r), -r.expiration)):
        size = _wire_size(r)
        if used + size > _REPLY_RECORD_BUDGET:
            break
        out.append(r)
        used += size
    return out


class BootstrapRefused(BootstrapError, SwarmKeyMismatch):
    """Every bootstrap peer that answered refused the handshake: it is in another swarm (another
    swarm key, or a key on one side only). Retrying cannot help; the message says what to fix."""

    def __init__(self, refusal: SwarmKeyMismatch):
        SwarmKeyMismatch.__init__(self, refusal.code, refusal.refused_by_peer)
        self.args = (f"could not join: the bootstrap peer refused the handshake — {refusal.hint}",)


class DHTNode:
    """One Kademlia peer. ``listen=None`` runs it in client mode (no inbound connections).

    ``swarm_key`` (a :class:`~dht.swarmkey.SwarmKey` or its 32 bytes) makes it a peer of that
    private swarm: it only talks to peers holding the same key.
    """

    def __init__(
        self,
        identity: Identity | None = None,
        listen: tuple[str, int] | None = ("127.0.0.1", 0),
        *,
        config: DHTConfig | None = None,
        limits: Limits | None = None,
        announce_host: str | None = None,
        prologue: bytes | None = None,
        swarm_key: SwarmKey | bytes | None = None,
    ):
        self.identity = identity or Identity()
        self.peer_id = self.identity.peer_id
        self.config = config or DHTConfig()
        kw = {"prologue": prologue} if prologue is not None else {}
        self.host = Host(self.identity, listen, limits=limits, announce_host=announce_host, swarm_key=swarm_key,
                         **kw)
        self.node_id = node_id_of(self.peer_id)
        self.routing = RoutingTable(self.node_id, k=self.config.k)
        self.storage = RecordStore(
            max_value_size=self.config.max_value_size,
            max_records=self.config.max_records,
            max_records_per_source=self.config.max_records_per_source,
            max_ttl=self.config.max_ttl,
            max_bytes=self.config.max_bytes,
            max_bytes_per_source=self.config.max_bytes_per_source,
        )
        self._originated: dict[tuple[bytes, bytes | None], Record] = {}
        self._tasks: set[asyncio.Task] = set()
        self._maintenance: asyncio.Task | None = None
        self._rng = random.Random()
        self._received_at: dict[bytes, float] = {}  # key -> when a peer last replicated it to us
        self._next_republish = time.monotonic() + self._jittered(self.config.republish_interval)
        self._started = False
        self._joined = False  # start() succeeded and close() has not run: the routing table is worth saving
        self._cache_saved: set[str] = set()
        self._cache_saved_at: float | None = None
        self._cache_warned = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def multiaddrs(self) -> list[Multiaddr]:
        return self.host.listen_addrs

    @property
    def client_mode(self) -> bool:
        return self.host.client_mode

    async def start(self, bootstrap: Iterable[Multiaddr | str] = ()) -> None:
        """Listen, then join through ``bootstrap``; with no bootstrap this is the first peer.

        Addresses that refuse or time out are retried with backoff until ``config.bootstrap_timeout``
        (see ``dht.bootstrap``): under churn the peers a newcomer was told about may be dead, or
        still starting. Once every given address has failed at least once, the peers listed in
        ``config.peer_cache`` are dialed too. With no bootstrap address at all the cache is *not*
        used: "no bootstrap" means "start a new swarm", and joining whatever swarm a previous run on
        this machine belonged to would be a surprise (the cache is still written, for a restart
        that names a bootstrap peer which has since died).

        Raises BootstrapError (and cleans up) when no peer answers within the timeout, and
        BootstrapRefused at once when every given peer refuses our swarm key.
        """
        h = self.host
        h.on_request("ping", self._rpc_ping)
        h.on_request("find_node", self._rpc_find_node)
        h.on_request("find_value", self._rpc_find_value)
        h.on_request("store", self._rpc_store)
        h.on_connect.append(self._learn)
        await h.start()
        self._started = True
        addrs = [Multiaddr.parse(a) if isinstance(a, str) else a for a in bootstrap]
        try:
            if addrs:
                await self._bootstrap(addrs)
        except BaseException:
            await self.close()
            raise
        self._joined = True
        self._maintenance = asyncio.get_running_loop().create_task(self._maintain())

    async def _bootstrap(self, addrs: list[Multiaddr]) -> None:
        cfg = self.config
        cache = self._peer_cache
        cached = load_peer_cache(cache, cfg.peer_cache_size) if cache is not None else []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        plan = DialPlan(addrs, cached, now=t0, timeout=cfg.bootstrap_timeout, rng=self._rng)
        attempts: dict[asyncio.Task, Multiaddr] = {}
        refusals: list[SwarmKeyMismatch] = []
        joined = False
        try:
            while not joined:
                now = loop.time()
                for addr in plan.due(now):
                    attempts[self._spawn(self._reach(addr))] = addr
                if plan.expired(now) or plan.given_up or (not attempts and plan.idle):
                    break
                if not attempts:
                    await asyncio.sleep(plan.wait(now))
                    continue
                done, _ = await asyncio.wait(attempts, timeout=plan.wait(now), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    addr = attempts.pop(task)
                    error = task.exception() if not task.cancelled() else PeerUnreachable("dial cancelled")
                    if error is None:
                        joined = True
                        if plan.targets[str(addr)].cached:
                            log.warning("every bootstrap address failed; joined through %s from the peer cache %s",
                                        addr, cache)
                        continue
                    if not isinstance(error, (DHTError, OSError)):
                        raise error  # a bug, not a network failure: let it surface
                    if isinstance(error, SwarmKeyMismatch):
                        refusals.append(error)
                    plan.failed(addr, str(error) or type(error).__name__, loop.time(),
                                permanent=self._permanent_failure(addr, error),
                                refused=isinstance(error, SwarmKeyMismatch))
        finally:
            for task in attempts:
                task.cancel()
            if attempts:
                await asyncio.gather(*attempts, return_exceptions=True)
        if not joined:
            if plan.all_refused:
                raise BootstrapRefused(refusals[0])
            raise BootstrapError(self._bootstrap_failure(plan, loop.time() - t0))
        # Kademlia join: look ourselves up to fill the near buckets; the far ones are refreshed
        # in the background (``_maintain``) so that start() returns as soon as we are routable.
        await self._lookup_nodes(self.node_id)

    async def _reach(self, addr: Multiaddr) -> None:
        """One bootstrap attempt: dial and ping. The plan's deadline bounds it (the caller cancels
        what is still in flight), so the dial itself may take the whole budget."""
        conn = await self.host.connect_addr(addr, timeout=self.config.bootstrap_timeout)
        await conn.call("ping", None, timeout=self.config.rpc_timeout)
        self._learn(conn)

    def _permanent_failure(self, addr: Multiaddr, error: BaseException) -> bool:
        """Failures no retry can fix: the peer is in another swarm, the address is our own, or
        another peer answers there. A handshake cut short (peer dying, listener overloaded) is
        transient."""
        return isinstance(error, (SwarmKeyMismatch, PeerIdMismatch)) or addr.peer_id == self.peer_id

    def _bootstrap_failure(self, plan: DialPlan, elapsed: float) -> str:
        given = plan.given
        if plan.given_up:
            return (f"could not join: every bootstrap peer rejected the connection ({plan.summary()}); "
                    "check the addresses (the /p2p/ part must be the peer id the peer prints) and --swarm-key-file")
        cached = plan.cached
        tried_cache = sum(1 for t in cached if t.attempts)
        also = f", nor any of {tried_cache} cached peer(s) from {self._peer_cache}" if tried_cache else ""
        return (f"could not reach any bootstrap peer within {elapsed:.1f} s ({len(given)} address(es), "
                f"{sum(t.attempts for t in given)} attempt(s); {plan.summary()}){also}; "
                "check the address and that the peer is running")

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

    async def close(self) -> None:
        """Cancel every task this node owns, save the peer cache, and close all connections."""
        tasks = list(self._tasks)
        if self._maintenance is not None:
            tasks.append(self._maintenance)
        await cancel_all(tasks)
        if self._joined:
            self._joined = False
            self.save_peer_cache()
        if self._started:
            await self.host.close()

    async def __aenter__(self) -> DHTNode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ routing table upkeep

    def _learn(self, conn: Connection) -> None:
        """Add the peer behind ``conn`` to the routing table if it accepts inbound connections."""
        if conn.remote_peer is None or conn.remote_listen_port is None or conn.remote_host is None:
            return
        self._add_contact(Contact(conn.remote_peer, (conn.remote_host, conn.remote_listen_port)))

    def _add_contact(self, contact: Contact) -> None:
        if contact.peer_id == self.peer_id:
            return
        stale = self.routing.update(contact, time.monotonic())
        if stale is not None:
            self._spawn(self._check_liveness(stale))

    async def _check_liveness(self, contact: Contact) -> None:
        """A full bucket met a new peer: keep the old one if it still answers (Kademlia favours
        long-lived peers), else evict it and let the newcomer in from the replacement cache."""
        try:
            await self.host.call(contact.peer_id, contact.addr, "ping", None, self.config.rpc_timeout)
            self.routing.update(contact, time.monotonic())
        except DHTError:
            self.routing.remove(contact.peer_id)

    async def _call(self, contact: Contact, method: str, args: Any) -> Any:
        try:
            result = await self.host.call(contact.peer_id, contact.addr, method, args, self.config.rpc_timeout)
        except DHTError:
            self.routing.mark_failed(contact.peer_id, contact.addr)
            raise
        conn = self.host.connection(contact.peer_id)
        if conn is not None:  # its address as the connection shows it, not as whoever named it said
            self._learn(conn)
        return result

    # ------------------------------------------------------------------ RPC handlers (untrusted input)

    async def _rpc_ping(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        return None

    def _target(self, args: Any) -> int:
        if not (isinstance(args, bytes) and len(args) == 32):
            raise ProtocolError("target must be 32 bytes")
        return int.from_bytes(args, "big")

    async def _rpc_find_node(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        target = self._target(args)
        return _encode_contacts(self.routing.closest(target, self.config.k, exclude={conn.remote_peer}))

    async def _rpc_find_value(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        if not (isinstance(args, bytes) and len(args) <= 1024):
            raise ProtocolError("key must be bytes of at most 1024")
        records = _within_reply_budget(self.storage.get(args, time.time()))
        closest = self.routing.closest(key_id(args), self.config.k, exclude={conn.remote_peer})
        return [[r.to_wire() for r in records], _encode_contacts(closest)]

    async def _rpc_store(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        if not (isinstance(args, list) and len(args) <= 256):
            raise ProtocolError("store takes a list of at most 256 records")
        now, group = time.time(), address_group(conn.remote_host, relayed_via(conn))
        results = []
        for item in args:
            try:
                record = Record.from_wire(item)
                stored = self.storage.store(record, now, source=conn.remote_peer, group=group)
                # A valid STORE for the key, newer or a copy of what we hold: its sender is spreading
                # it to the k closest this period, so we need not republish it ourselves.
                self._received_at[record.key] = time.monotonic()
                results.append(stored)
            except InvalidRecord as e:
                results.append(str(e)[:200])
        return results

    # ------------------------------------------------------------------ lookups

    async def _run_lookup(self, target: int, method: str, arg: bytes, want_records: bool,
                          latest: bool) -> LookupResult:
        lookup = Lookup(target, self.routing.closest(target, self.config.k), self.config.k,
                        self.config.alpha, own_peer=self.peer_id)
        result = LookupResult(records=[])
        if want_records:
            local = self.storage.get(arg, time.time())
            if local:
                result.records.extend(local)
                if not latest:
                    return result
        pending: dict[asyncio.Task, Contact] = {}
        found_from = 0
        try:
            while True:
                for contact in lookup.next_queries():
                    pending[self._spawn(self._call(contact, method, arg))] = contact
                if not pending or lookup.finished:
                    break
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    contact = pending.pop(task)
                    try:
                        reply = task.result()
                        if want_records:
                            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], list)):
                                raise ProtocolError("malformed find_value reply")
                            records = self._valid_records(reply[0][:1000], arg)
                            found = _decode_contacts(reply[1], self.config.k)
                            if records:
                                result.records.extend(records)
                                found_from += 1
                                result.hops = result.hops or lookup.depth(contact)
                        else:
                            found = _decode_contacts(reply, self.config.k)
                        lookup.on_response(contact, self.routing.vouched(found))
                    except (DHTError, InvalidRecord) as e:
                        if isinstance(e, (ProtocolError, InvalidRecord)):
                            log.debug("bad reply from %s: %s", contact.peer_id, e)
                        lookup.on_failure(contact)
                if want_records and found_from and not latest:
                    lookup.stop()
        finally:
            for task in pending:
                task.cancel()
        result.closest = lookup.result()
        result.queried = lookup.queried
        self.routing.touch(target, time.monotonic())
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
                validate_record(record, now, st.max_value_size, st.max_key_size, st.max_ttl)
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

    # ------------------------------------------------------------------ public API

    def owned(self, name: str) -> str:
        """``name`` with this peer's owner marker: only this peer may write that key or sub-key."""
        return owned_name(name.encode(), self.peer_id).decode()

    async def store(self, key: str | bytes, value: Any, expiration: float,
                    subkey: str | None = None, closest: list[Contact] | None = None) -> int:
        """Store ``value`` under ``key`` (or ``key[subkey]``) until the unix time ``expiration``.

        Replicates to the k closest peers and republishes until expiry. Returns how many peers
        (this one included) accepted the record; raises InvalidRecord for a record no peer would
        accept (too large, expired, owned by another peer).

        ``closest``: the key's k closest peers as a lookup of the same key just found them (e.g.
        ``lookup_value(key).closest``): the record goes to them without a lookup of its own, one
        round trip sooner. Republishing looks them up afresh.
        """
        kb = _key_bytes(key)
        sb = subkey.encode() if subkey is not None else None
        record = Record(kb, sb, pack(value), float(expiration))
        owner = owner_of(kb) or owner_of(sb)
        if owner is not None:
            if owner != self.peer_id:
                raise InvalidRecord(f"cannot write {key!r}: it is owned by another peer ({owner})")
            record = sign_record(record, self.identity)
        validate_record(record, time.time(), self.storage.max_value_size, self.storage.max_key_size,
                        self.storage.max_ttl)
        self._originated[(kb, sb)] = record
        return await self._replicate([record], closest)

    async def _replicate(self, records: list[Record], closest: list[Contact] | None = None) -> int:
        """Send records (all under one key) to the k closest peers (looked up unless given) and
        keep a local copy."""
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
            closest = [c for c in closest if c.peer_id != self.peer_id and c.addr is not None][: self.config.k]
        wire = [r.to_wire() for r in records]

        async def send(contact: Contact) -> bool:
            try:
                reply = await self._call(contact, "store", wire)
                return isinstance(reply, list) and any(x is True for x in reply)
            except DHTError:
                return False

        results = await asyncio.gather(*(send(c) for c in closest))
        return accepted + sum(results)

    async def lookup_value(self, key: str | bytes, latest: bool = False) -> LookupResult:
        """Find records under ``key``. ``latest=False`` stops at the first peer that has some;
        ``latest=True`` asks all k closest peers and merges (freshest value per sub-key)."""
        kb = _key_bytes(key)
        result = await self._run_lookup(key_id(kb), "find_value", kb, True, latest)
        now = time.time()
        result.records = [r for r in merge_records(result.records) if r.expiration > now]
        return result

    async def get(self, key: str | bytes, latest: bool = False) -> ValueWithExpiration | dict[str, ValueWithExpiration] | None:
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

    # ------------------------------------------------------------------ maintenance

    async def _maintain(self) -> None:
        # The first tick refreshes every bucket (they start untouched), filling the far ones.
        while True:
            await asyncio.sleep(self.config.maintenance_period)
            try:
                self.storage.remove_expired(time.time())
                await self._refresh()
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
        now = time.time()
        recent = time.monotonic() - self.config.republish_interval
        self._received_at = {k: t for k, t in self._received_at.items() if t > recent}
        for name, rec in list(self._originated.items()):
            if rec.expiration <= now:
                del self._originated[name]
        # What we wrote ourselves is republished even if our own store dropped it (full, replaced).
        chosen: dict[tuple[bytes, bytes | None], Record] = dict(self._originated)
        for rec in self.storage.records():
            if rec.expiration > now and (force or rec.key not in self._received_at):
                chosen.setdefault((rec.key, rec.subkey), rec)
        by_key: dict[bytes, list[Record]] = {}
        for rec in chosen.values():
            by_key.setdefault(rec.key, []).append(rec)
        sem = asyncio.Semaphore(8)

        async def one(records: list[Record]) -> None:
            async with sem:
                try:
                    await self._replicate(records)
                except DHTError:
                    pass

        await asyncio.gather(*(one(rs[i : i + 256]) for rs in by_key.values() for i in range(0, len(rs), 256)))
