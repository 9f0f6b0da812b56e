"""DHTNode: a Kademlia peer — its public API (store/get, ...) and lifecycle (start, bootstrap, close).

This is the asyncio shell around the sans-IO pieces: ``routing.RoutingTable`` and ``routing.Lookup``
decide whom to ask, ``storage.RecordStore`` decides what to keep, ``transport.Host`` moves bytes.
The node is put together from three parts: ``protocol.NodeProtocol`` (the RPC handlers),
``lookup.Lookups`` (iterative lookups, reads, replication) and ``maintenance.Maintenance`` (routing
table upkeep, liveness, republish, peer cache). Every background task is owned by the node and
cancelled by ``close()``.

Values are any msgpack-able object. A key holds either one value or a dictionary of sub-keys, each
with its own expiration (used for group matchmaking and progress reports). Keys and sub-keys that
contain ``[owner:<PeerID>]`` (see ``DHTNode.owned``) can only be written by that peer: every node
checks the signature before storing. ``store_owned``/``get_owned`` keep one such entry per peer
under a shared key, read back as {PeerID: value}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any, Iterable, Iterator, Sequence

from .autonat import probe_reachable, reserve_relays
from .bootstrap import DialPlan
from .config import DHTConfig
from .connection import Connection
from .errors import BootstrapError, DHTError, InvalidRecord, PeerIdMismatch, PeerUnreachable, RPCError
from .identity import Identity, PeerID
from .latency import RttEstimator
from .limits import Limits
from .lookup import Lookups, key_bytes
from .maintenance import Maintenance
from .multiaddr import Multiaddr
from .noise import SwarmKeyMismatch
from .owned import OwnedValue, owned_values
from .peercache import load_peer_cache
from .protocol import NodeProtocol, notice_request
from .routing import Contact, RoutingTable, key_id, node_id_of
from .storage import PROCESS_OWNERS, Record, RecordStore, owned_name, owner_of, sign_record, validate_record
from .swarmkey import SwarmKey
from .tasks import TaskGroup
from .transport import Host
from .watchers import Watchers
from .wire import pack

log = logging.getLogger("dht.node")

_NOTICE_TIMEOUT = 2.0  # s: a notice not answered by then is dropped (it is a hint)


class BootstrapRefused(BootstrapError, SwarmKeyMismatch):
    """Every bootstrap peer that answered refused the handshake: it is in another swarm (another
    swarm key, or a key on one side only). Retrying cannot help; the message says what to fix."""

    def __init__(self, refusal: SwarmKeyMismatch):
        SwarmKeyMismatch.__init__(self, refusal.code, refusal.refused_by_peer)
        self.args = (f"could not join: the bootstrap peer refused the handshake — {refusal.hint}",)


class DHTNode(NodeProtocol, Lookups, Maintenance):
    """One Kademlia peer. ``listen=None`` runs it in client mode (no inbound connections).
    ``reachable=False`` (behind NAT): it listens but announces no direct address, reserves at
    ``config.relays`` relays among its peers and is a full member reached through them.
    ``reachable=None``: it asks its first peers to dial it back (``dht.autonat``) and is either.

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
        reachable: bool | None = True,
    ):
        self.identity = identity or Identity()
        self.peer_id = self.identity.peer_id
        self.config = config or DHTConfig()
        kw = {"prologue": prologue} if prologue is not None else {}
        self.host = Host(self.identity, listen, limits=limits, announce_host=announce_host, swarm_key=swarm_key,
                         reachable=reachable, **kw)
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
        self._verified = PROCESS_OWNERS  # (shared by the peers of a process)
        self._rtt = RttEstimator(min(self.config.hedge_floor, self.config.rpc_timeout), self.config.rpc_timeout)
        self._originated: dict[tuple[bytes, bytes | None], Record] = {}
        self._tasks = TaskGroup("dht node", log=log)  # maintenance, lookups' queries, liveness checks
        self._rng = random.Random()
        self._received_at: dict[bytes, float] = {}  # key -> when a peer last replicated it to us
        self._watches: dict[bytes, list[asyncio.Event]] = {}  # key -> set when a peer's write of it lands
        self._watchers: Watchers = Watchers()  # peers to tell of noticed writes of keys we hold
        self._watching: dict[tuple[bytes, PeerID], float] = {}  # (key, holder) -> until when it may tell us
        self._notices: dict[bytes, list[asyncio.Event]] = {}  # key -> set when a holder tells us of a write
        self._next_republish = time.monotonic() + self._jittered(self.config.republish_interval)
        self._republish_started = time.monotonic()
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

    async def start(self, bootstrap: Iterable[Multiaddr] = ()) -> None:
        """Listen, then join through ``bootstrap``; with no bootstrap this is the first peer.

        Addresses that refuse or time out are retried with backoff until ``config.bootstrap_timeout``
        (see ``dht.bootstrap``): under churn the peers a newcomer was told about may be dead, or
        still starting. Once every given address has failed at least once, the peers listed in
        ``config.peer_cache`` are dialed too. With no bootstrap address at all the cache is *not*
        used: "no bootstrap" means "start a new swarm", and joining whatever swarm a previous run on
        this machine belonged to would be a surprise (the cache is still written, for a restart
        that names a bootstrap peer which has since died).

        Raises BootstrapError (and cleans up) when no peer answers within the timeout, and
        BootstrapRefused at once when every given peer refuses our swarm key. Text is parsed by the
        caller, once (``Multiaddr.parse``): a string here is a TypeError, before anything starts.
        """
        addrs = list(bootstrap)
        if not all(isinstance(a, Multiaddr) for a in addrs):
            raise TypeError(f"DHTNode.start takes Multiaddr objects, got {addrs!r}: parse text with Multiaddr.parse")
        h = self.host
        self._serve()
        h.on_connect.append(self._learn)
        await h.start()
        self._started = True
        try:
            if addrs:
                await self._bootstrap(addrs)
            if h.reachable is None:
                await self._probe_reachable()
            if addrs and not h.reachable and not h.client_mode:
                await self._reserve_relays()
        except BaseException:
            await self.close()
            raise
        self._joined = True
        self._tasks.spawn(self._maintain(), name="dht maintenance")

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
                    attempts[self._tasks.spawn(self._reach(addr), awaited=True)] = addr
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
        # Once more if no one answered: the table would hold the bootstrap peer alone until the
        # first upkeep round.
        if not await self._lookup_nodes(self.node_id):
            await self._lookup_nodes(self.node_id)

    async def _reach(self, addr: Multiaddr) -> None:
        """One bootstrap attempt: dial and ping. The plan's deadline bounds it (the caller cancels
        what is still in flight), so the dial itself may take the whole budget."""
        conn = await self.host.connect_addr(addr, timeout=self.config.bootstrap_timeout)
        await conn.call("ping", None, timeout=self.config.rpc_timeout)
        self._learn(conn)

    async def _probe_reachable(self) -> None:
        """Ask peers we are connected to whether they can dial us; unknown (nobody answered)
        counts as reachable, as before this was asked."""
        found = await probe_reachable(self.host, [c.peer_id for c in self.routing if c.addr is not None])
        self.host.reachable = found is not False
        log.info("peers %s dial this node back: it is %s", "can" if self.host.reachable else "cannot",
                 "reachable" if self.host.reachable else "behind NAT, reachable through relays")
        if self.host.reachable:
            self.host.announce_addrs()  # (behind NAT, reserving at relays announces)

    async def _reserve_relays(self, lookup: bool = True) -> None:
        """Behind NAT: hold reservations at ``config.relays`` public peers that relay (at start, and
        in maintenance when one was lost), then look ourselves up so that our closest peers learn
        our circuit addresses (connected ones are told at once, see ``Host.announce_addrs``)."""
        held = {a.relay_id for a in self.host.circuit_addrs}
        if len(held) >= self.config.relays:
            return
        public = sorted((c for c in self.routing if c.addr is not None and c.peer_id not in held),
                        key=lambda c: c.last_seen, reverse=True)[: 4 * self.config.relays]
        got = await reserve_relays(self.host, [Multiaddr.from_host_port(*c.addr, c.peer_id) for c in public],
                                   self.config.relays, self.config.rpc_timeout)
        if not got:
            log.warning("not reachable and no peer took a relay reservation: peers cannot dial this node")
        if lookup:
            await self._lookup_nodes(self.node_id)

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

    async def close(self) -> None:
        """Cancel every task this node owns, save the peer cache, and close all connections."""
        await self._tasks.close()
        if self._joined:
            self._joined = False
            self.save_peer_cache()
        if self._started:
            await self.host.close()

    async def __aenter__(self) -> DHTNode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ writes

    def owned(self, name: str) -> str:
        """``name`` with this peer's owner marker: only this peer may write that key or sub-key."""
        return owned_name(name.encode(), self.peer_id).decode()

    async def store(self, key: str | bytes, value: Any, expiration: float,
                    subkey: str | None = None, closest: list[Contact] | None = None,
                    notice: int | None = None) -> int:
        """Store ``value`` under ``key`` (or ``key[subkey]``) until the unix time ``expiration``.

        Replicates to the k closest peers and republishes until expiry. Returns how many peers
        (this one included) accepted the record; raises InvalidRecord for a record no peer would
        accept (too large, expired, owned by another peer).

        ``closest``: the key's k closest peers as a lookup of the same key just found them (e.g.
        ``lookup_value(key).closest``; a latest lookup's holds only its read quorum): the record goes
        to them without a lookup of its own, one round trip sooner. Republishing looks them up afresh.
        ``notice`` (a tag): the holders tell the key's watchers, once per tag (see ``notices``).
        """
        kb = key_bytes(key)
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
        return await self._replicate([record], closest, notice)

    def nearest_known(self, key: str | bytes) -> list[Contact]:
        """The k dialable contacts of our routing table nearest ``key``, without a lookup: the key's
        holders where the table is complete near it (small swarms), a lookup's starting point elsewhere."""
        target = key_id(key_bytes(key))
        return [c for c in self.routing.closest(target, 2 * self.config.k) if c.dialable][: self.config.k]

    async def store_owned(self, key: str | bytes, name: str, value: Any, expiration: float,
                          closest: list[Contact] | None = None, notice: int | None = None) -> int:
        """Store our entry under ``key``: ``value`` under our own ``name`` sub-key (``owned``), signed,
        so that ``get_owned(key, name)`` reads it back as ours. Otherwise as ``store``."""
        return await self.store(key, value, expiration, subkey=self.owned(name), closest=closest, notice=notice)

    # ------------------------------------------------------------------ what this node holds

    def local_owned(self, key: str | bytes, name: str, *, max_size: int | None = None) -> dict[PeerID, OwnedValue]:
        """As ``get_owned(key, name).values``, from the records this node holds: no RPC. On one of a
        key's holders a peer's write shows here half a round trip after it left (a read: a whole one)."""
        limit = self.storage.max_value_size if max_size is None else max_size
        return owned_values(self.storage.get(key_bytes(key), time.time()), name, self._verified, limit)

    @contextlib.contextmanager
    def watch(self, key: str | bytes) -> Iterator[asyncio.Event]:
        """An event that every peer's write of ``key`` landing here sets (clear it to wait for the next)."""
        with _event_in(self._watches, key_bytes(key)) as event:
            yield event

    def _key_stored(self, key: bytes) -> None:
        for event in self._watches.get(key, ()):
            event.set()

    @contextlib.contextmanager
    def notices(self, key: str | bytes) -> Iterator[asyncio.Event]:
        """An event that a holder sets when it tells us of a write of ``key`` that asked for a
        notice (reads with ``get_owned(..., watch=s)`` ask holders to; writes with
        ``store_owned(..., notice=tag)`` ask for one): the write's records it handed over are in
        ``local_owned`` already; read the key again for anything else."""
        with _event_in(self._notices, key_bytes(key)) as event:
            yield event

    def _watch_at(self, key: bytes, holders: list[Contact], seconds: float) -> None:
        """We asked ``holders`` to tell us of writes of ``key`` for ``seconds``."""
        until = time.monotonic() + seconds
        if len(self._watching) > 4096:
            now = time.monotonic()
            self._watching = {k: t for k, t in self._watching.items() if t > now}
        for c in holders:
            self._watching[(key, c.peer_id)] = until

    def _noticed(self, holder: PeerID, key: bytes, records: Sequence[Record] = (), group: str | None = None) -> None:
        """A holder tells us of a write of ``key``, if we asked it to: keep the write's records it
        hands over (checked as any store's: a signature, newer than ours) for ``local_owned``,
        then wake the key's readers."""
        if self._watching.get((key, holder), 0.0) <= time.monotonic():
            return
        now = time.time()
        for record in records:
            if record.key == key:
                try:
                    self.storage.store(record, now, source=holder, group=group)
                    self._received_at[key] = time.monotonic()  # (its writer spreads it: no republish by us)
                except InvalidRecord:
                    pass
        for event in self._notices.get(key, ()):
            event.set()

    def _tell_watchers(self, key: bytes, tag: int, writer: PeerID, records: Sequence[Record] = ()) -> None:
        """A write of ``key`` asked for a notice: tell each peer watching it here, handing it the
        write's ``records`` (best effort)."""
        wire = notice_request(key, records)
        for conn in self._watchers.due(key, tag, writer, time.monotonic()):
            if not conn.is_closed:
                try:
                    self._tasks.spawn(self._tell(conn, wire))
                except RuntimeError:  # closing
                    return

    async def _tell(self, conn: Connection, wire: Any) -> None:
        try:
            await conn.call("notice", wire, timeout=_NOTICE_TIMEOUT)
        except RPCError:  # an older watcher takes the key alone
            if isinstance(wire, list):
                await self._tell(conn, wire[0])
        except DHTError:
            pass


@contextlib.contextmanager
def _event_in(table: dict[bytes, list[asyncio.Event]], key: bytes) -> Iterator[asyncio.Event]:
    """A new event listed under ``key`` in ``table`` while the block runs (``watch``, ``notices``)."""
    event = asyncio.Event()
    table.setdefault(key, []).append(event)
    try:
        yield event
    finally:
        events = table.get(key, [])
        if event in events:
            events.remove(event)
        if not events:
            table.pop(key, None)
