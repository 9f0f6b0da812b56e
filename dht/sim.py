"""Thousands of DHT nodes in one process on a virtual clock, to measure lookup hops and get success
under churn at sizes no test bed reaches.

Each node runs the real sans-IO cores (``RoutingTable``, ``Lookup``, ``RecordStore`` with record
validation, ``RttEstimator``, ``republish_batches``) and answers the four RPCs as ``dht.protocol``
does; its lookups, joins, bucket refreshes and republish rounds follow ``dht.lookup``,
``dht.node`` and ``dht.maintenance`` step for step, as callbacks on a discrete-event loop instead of
coroutines. Messages are not encoded: a reply carries the responder's records and ``Contact``s
(read-only to the caller, whose routing table keeps copies of its own). The network gives every
node an access latency (one-way link latency: the sum of both ends', with jitter) and drops each
message with a given probability; a dead node answers nothing, so every call to it costs the
caller its timeout.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .config import DHTConfig
from .errors import InvalidRecord
from .identity import Identity, PeerID
from .latency import RttEstimator, Stragglers
from .maintenance import republish_batches
from .routing import Contact, Lookup, RoutingTable, key_id
from .storage import Record, RecordStore, merge_records, validate_record

__all__ = ["EventLoop", "GetStats", "NetConfig", "SimLookup", "SimNode", "Simulation", "hop_bound"]

_FAILED = object()  # a call's outcome when no reply came within the RPC timeout


def hop_bound(n: int, k: int) -> int:
    """Hops a lookup among ``n`` nodes with ``k``-buckets should stay within: log_k(n), plus 2."""
    return math.ceil(math.log2(n) / math.log2(k)) + 2


@dataclass
class NetConfig:
    """The simulated network, and how often each node runs its upkeep."""

    latency_median: float = 0.02  #: a node's one-way access latency in seconds: lognormal, this median
    latency_sigma: float = 0.6
    jitter: float = 0.1  #: each message's latency varies by up to this fraction
    loss: float = 0.01  #: probability that a message (request or reply) is lost
    #: seconds between a node's upkeep rounds (the real node's ``maintenance_period`` is 5 s; coarser
    #: here so that thousands of idle nodes cost little: refresh and republish run on their own periods)
    tick: float = 60.0


class EventLoop:
    """A virtual clock and the callbacks due on it, run in time order (ties: in scheduling order)."""

    def __init__(self, start: float = 1_000_000.0):
        self.now = start
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()

    def call_at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn, args))

    def run(self, until: float | None = None, done: Callable[[], bool] | None = None) -> None:
        """Run callbacks until the clock would pass ``until``, ``done()`` holds, or none is left."""
        queue = self._queue
        while queue and not (done is not None and done()):
            when, _, fn, args = queue[0]
            if until is not None and when > until:
                break
            heapq.heappop(queue)
            self.now = when
            fn(*args)
        if until is not None and (done is None or not done()):
            self.now = max(self.now, until)


@dataclass
class SimLookup:
    """What one lookup found: as ``dht.LookupResult``, plus when it started and ended (virtual)."""

    records: list[Record] = field(default_factory=list)
    hops: int = 0
    queried: int = 0
    closest: list[Contact] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


class SimNode:
    """One DHT node: the real routing table and store, with the node's RPC handlers and state."""

    def __init__(self, sim: Simulation, identity: Identity, addr: tuple[str, int], access: float):
        cfg = sim.config
        self.sim, self.identity, self.peer_id, self.addr = sim, identity, identity.peer_id, addr
        self.contact_self = Contact(self.peer_id, addr)
        self.node_id = self.contact_self.node_id
        self.access = access
        self.alive = True
        self.joined = False
        self.routing = RoutingTable(self.node_id, cfg.k)
        self.storage = RecordStore(cfg.max_value_size, max_records=cfg.max_records,
                                   max_ttl=cfg.max_ttl, max_records_per_source=cfg.max_records_per_source)
        self.rtt = RttEstimator(cfg.hedge_floor, cfg.rpc_timeout)
        self.rng = random.Random(sim.rng.getrandbits(64))
        self.originated: dict[tuple[bytes, bytes | None], Record] = {}
        self.received_at: dict[bytes, float] = {}
        self.next_republish = 0.0
        self.republish_started = sim.loop.now  # as a real node's: its creation

    def __repr__(self) -> str:
        return f"SimNode({self.peer_id.short()}, {'up' if self.alive else 'dead'})"

    # ------------------------------------------------------------------ RPC handlers (dht.protocol)

    def handle(self, caller: Contact, method: str, arg: Any) -> Any:
        self.learn(caller)
        now, k = self.sim.loop.now, self.sim.config.k
        if method == "find_node":
            return self.routing.closest(arg, k, exclude={caller.peer_id})
        if method == "find_value":  # (``protocol.value_request``: the key, or it with the asker's window)
            key, within, known = arg if isinstance(arg, tuple) else (arg, None, frozenset())
            closest = self.routing.closest(key_id(key), k + len(known), exclude={caller.peer_id}, within=within)
            return self.storage.get(key, now), [c for c in closest if c.node_id not in known][:k]
        if method == "store":
            results = []
            for record in arg:
                try:
                    results.append(self.storage.store(record, now, source=caller.peer_id))
                    self.received_at[record.key] = now
                except InvalidRecord:
                    results.append(False)
            return results
        return None  # ping

    # ------------------------------------------------------------------ routing upkeep (dht.maintenance)

    def learn(self, contact: Contact) -> None:
        """A peer called us or answered: add it; a full bucket pings its oldest contact first."""
        if contact.peer_id == self.peer_id:
            return
        stale = self.routing.update(Contact(contact.peer_id, contact.addr), self.sim.loop.now)
        if stale is not None:
            self.sim.call(self, stale, "ping", None, lambda reply: self._checked(stale, reply))

    def _checked(self, contact: Contact, reply: Any) -> None:
        if reply is _FAILED:
            self.routing.remove(contact.peer_id)
        else:
            self.routing.update(contact, self.sim.loop.now)

    def tick(self) -> None:
        """One upkeep round: expire records, refresh stale buckets, republish when due; the next
        round is timed from the end of this one."""
        if not self.alive:
            return
        sim, now = self.sim, self.sim.loop.now
        self.storage.remove_expired(now)
        targets = self.routing.buckets_to_refresh(now, sim.config.refresh_interval, self.rng)

        def refreshed() -> None:
            if sim.loop.now >= self.next_republish:
                self.republish(then=republished)
            else:
                sim.loop.call_at(sim.loop.now + sim.net.tick, self.tick)

        def republished() -> None:
            self.next_republish = sim.loop.now + sim.config.republish_interval * self.rng.uniform(0.75, 1.25)
            sim.loop.call_at(sim.loop.now + sim.net.tick, self.tick)

        _all_then([lambda cb, t=t: self.lookup(t, "find_node", t, lambda _: cb()) for t in targets], refreshed)

    def republish(self, then: Callable[[], None], force: bool = False) -> None:
        """``Maintenance.republish``: re-replicate what we hold, skipping keys received lately."""
        now, interval = self.sim.loop.now, self.sim.config.republish_interval
        recent = min(now - interval, self.republish_started)
        self.republish_started = now
        self.received_at = {k: t for k, t in self.received_at.items() if t > recent}
        self.originated = {n: r for n, r in self.originated.items() if r.expiration > now}
        batches = republish_batches(self.originated, self.storage.records(), self.received_at, now, force)
        _all_then([lambda cb, b=b: self.replicate(b, lambda _: cb()) for b in batches], then, limit=8)

    # ------------------------------------------------------------------ lookups and writes (dht.lookup)

    def lookup(self, target: int, method: str, arg: Any, done: Callable[[SimLookup], None],
               latest: bool = False) -> None:
        _LookupRun(self, target, method, arg, latest, done)

    def replicate(self, records: list[Record], done: Callable[[int], None]) -> None:
        """Store ``records`` (one key's) here and at the key's k closest peers; ``done(accepted)``."""
        now, key = self.sim.loop.now, records[0].key
        try:
            local = int(all(self.storage.store(r, now) for r in records))
        except InvalidRecord:
            local = 0

        def send(found: SimLookup) -> None:
            closest = [c for c in found.closest if c.peer_id != self.peer_id][: self.sim.config.k]
            acks = [local]

            def one(contact: Contact, cb: Callable[[], None]) -> None:
                def stored(reply: Any) -> None:
                    acks.append(int(isinstance(reply, list) and any(x is True for x in reply)))
                    cb()
                self.sim.call(self, contact, "store", records, stored)

            _all_then([lambda cb, c=c: one(c, cb) for c in closest], lambda: done(sum(acks)))

        self.lookup(key_id(key), "find_node", key_id(key), send)

    def store(self, key: bytes, value: bytes, ttl: float, done: Callable[[int], None]) -> None:
        """``DHTNode.store`` of a plain value: remembered for republishing, then replicated."""
        record = Record(key, None, value, self.sim.loop.now + ttl)
        self.originated[(key, None)] = record
        self.replicate([record], done)

    def get(self, key: bytes, done: Callable[[SimLookup], None], latest: bool = False) -> None:
        """``lookup_value``: the merged live records under ``key``, and how many hops found them."""
        def merged(result: SimLookup) -> None:
            now = self.sim.loop.now
            result.records = [r for r in merge_records(result.records) if r.expiration > now]
            done(result)
        self.lookup(key_id(key), "find_value", key, merged, latest)


class _LookupRun:
    """``Lookups._run_lookup`` on the virtual clock: alpha-parallel queries, a hedge (the next
    contact is asked) once a query runs past its peer's adaptive timeout, a stop at the first
    holder of the value unless ``latest``; then stragglers are left behind (``Stragglers``)."""

    def __init__(self, node: SimNode, target: int, method: str, arg: Any, latest: bool,
                 done: Callable[[SimLookup], None]):
        cfg = node.sim.config
        self.node, self.target, self.method, self.arg, self.latest, self.done = node, target, method, arg, latest, done
        window = cfg.read_window if latest else cfg.k
        self.lookup = Lookup(target, node.routing.closest(target, cfg.k), window, cfg.alpha, own_peer=node.peer_id,
                             wide=latest and node.sim.wide_latest)
        self.result = SimLookup(started=node.sim.loop.now)
        self.want_records = method == "find_value"
        self.outstanding = 0
        self.waiting: dict[PeerID, Contact] = {}  # asked, not answered, not yet past a timeout
        self.sent: dict[PeerID, float] = {}
        self.stragglers = Stragglers(window) if latest else None
        self.found_from = 0
        self.ended = False
        if self.want_records:
            local = node.storage.get(arg, node.sim.loop.now)
            if local:
                self.result.records.extend(local)
                if not latest:
                    self._finish()
                    return
        self._pump()

    def _pump(self) -> None:
        if self.ended:
            return
        node, sim = self.node, self.node.sim
        queries = self.lookup.next_queries()
        radius = self.lookup.radius() if self.want_records and queries else None
        arg = self.arg if radius is None else (self.arg, radius, frozenset(self.lookup.window_ids()))
        for contact in queries:
            self.outstanding += 1
            self.waiting[contact.peer_id], self.sent[contact.peer_id] = contact, sim.loop.now
            sim.call(node, contact, self.method, arg, lambda reply, c=contact: self._reply(c, reply))
            sim.loop.call_at(sim.loop.now + node.rtt.timeout(contact.peer_id), self._due, contact, True)
        if self.outstanding == 0 or self.lookup.finished:
            self._finish()

    def _due(self, contact: Contact, adaptive: bool) -> None:
        if self.ended or contact.peer_id not in self.waiting:
            return
        del self.waiting[contact.peer_id]
        if adaptive:
            self.node.rtt.timed_out(contact.peer_id)
        self.lookup.on_timeout(contact, replace=not self.latest)
        self._pump()

    def _reply(self, contact: Contact, reply: Any) -> None:
        self.outstanding -= 1
        self.waiting.pop(contact.peer_id, None)
        if self.ended:
            return
        if self.stragglers and reply is not _FAILED:
            loop = self.node.sim.loop
            self.stragglers.answered(loop.now - self.sent[contact.peer_id])
            cutoff = self.stragglers.cutoff()
            for peer, waited in self.waiting.items() if cutoff is not None else ():
                loop.call_at(self.sent[peer] + cutoff, self._due, waited, False)
        if reply is _FAILED:
            self.lookup.on_failure(contact)
        else:
            node, k = self.node, self.node.sim.config.k
            if self.want_records:
                wire, reply = reply
                records = _valid(node, wire, self.arg)
                if records:
                    self.result.records.extend(records)
                    self.found_from += 1
                    self.result.hops = self.result.hops or self.lookup.depth(contact)
            self.lookup.on_response(contact, node.routing.vouched(reply[:k]))
        if self.want_records and self.found_from and not self.latest:
            self.lookup.stop()
        self._pump()

    def _finish(self) -> None:
        self.ended = True
        now = self.node.sim.loop.now
        self.result.closest = self.lookup.result()
        self.result.queried = self.lookup.queried
        self.result.ended = now
        self.node.routing.touch(self.target, now, self.result.closest)
        self.done(self.result)


def _valid(node: SimNode, records: list[Record], key: bytes) -> list[Record]:
    """The reply's records of ``key`` that pass a storing node's checks (``Lookups._valid_records``)."""
    st, now, out = node.storage, node.sim.loop.now, []
    for record in records:
        try:
            validate_record(record, now, st.max_value_size, st.max_key_size, st.max_ttl)
        except InvalidRecord:
            continue
        if record.key == key:
            out.append(record)
    return out


def _all_then(starts: list[Callable[[Callable[[], None]], None]], then: Callable[[], None],
              limit: int | None = None) -> None:
    """Start each ``start(cb)`` (at most ``limit`` at once) and call ``then`` once every one has
    called its ``cb``: ``asyncio.gather`` (under a semaphore) for callbacks."""
    queue = list(reversed(starts))
    left = [len(starts)]
    if not starts:
        then()
        return

    def one_done() -> None:
        left[0] -= 1
        if queue:
            queue.pop()(one_done)
        elif left[0] == 0:
            then()

    for _ in range(min(len(queue), limit or len(queue))):
        if queue:  # (a start that completes at once starts the next itself)
            queue.pop()(one_done)


@dataclass
class GetStats:
    """Outcome of a batch of gets: hops of the successful ones, and their virtual latency."""

    asked: int
    succeeded: int
    hops: list[int]
    latency: list[float]
    queried: int = 0  # contacts the gets asked, all together

    @property
    def success(self) -> float:
        return self.succeeded / self.asked if self.asked else 1.0

    def hop_percentile(self, q: float) -> int:
        return _percentile(self.hops, q)

    def latency_percentile(self, q: float) -> float:
        return _percentile(self.latency, q)


def _percentile(values: list, q: float) -> Any:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Simulation:
    """A network of ``SimNode``s on one ``EventLoop``; deterministic for a given ``seed``."""

    def __init__(self, config: DHTConfig | None = None, net: NetConfig | None = None, seed: int = 0):
        self.config = config or DHTConfig()
        self.net = net or NetConfig()
        self.rng = random.Random(seed)
        self.loop = EventLoop()
        self.nodes: list[SimNode] = []
        self.by_addr: dict[tuple[str, int], SimNode] = {}
        self.rpcs = 0  # requests sent, for cost reports
        self.wide_latest = True  # latest lookups ask their whole window at once (False: alpha-paced, to compare)

    # ------------------------------------------------------------------ network

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes if n.alive and n.joined]

    def _any_live(self) -> SimNode | None:
        """A random live, joined node (by rejection: a scan of every node per join is quadratic)."""
        for _ in range(64):
            node = self.rng.choice(self.nodes)
            if node.alive and node.joined:
                return node
        live = self.live()
        return self.rng.choice(live) if live else None

    def call(self, src: SimNode, contact: Contact, method: str, arg: Any, done: Callable[[Any], None]) -> None:
        """Send a request; ``done(reply)`` when it comes back, ``done(_FAILED)`` after the RPC timeout
        when the request or reply was lost or the peer is dead (the peer is then marked failed)."""
        self.rpcs += 1
        loop, sent = self.loop, self.loop.now
        dst = self.by_addr.get(contact.addr) if contact.addr is not None else None
        if dst is None or dst.peer_id != contact.peer_id or self._lost():
            loop.call_at(sent + self.config.rpc_timeout, self._failed, src, contact, done)
        else:
            loop.call_at(sent + self._latency(src, dst), self._deliver, src, dst, contact, method, arg, done, sent)

    def _deliver(self, src: SimNode, dst: SimNode, contact: Contact, method: str, arg: Any,
                 done: Callable[[Any], None], sent: float) -> None:
        if not dst.alive or self._lost():
            self.loop.call_at(sent + self.config.rpc_timeout, self._failed, src, contact, done)
            return
        reply = dst.handle(src.contact_self, method, arg)
        self.loop.call_at(self.loop.now + self._latency(src, dst), self._replied, src, dst, reply, done, sent)

    def _replied(self, src: SimNode, dst: SimNode, reply: Any, done: Callable[[Any], None], sent: float) -> None:
        if not src.alive:
            return
        src.rtt.observe(dst.peer_id, self.loop.now - sent)
        src.learn(dst.contact_self)  # its address as the connection shows it
        done(reply)

    def _failed(self, src: SimNode, contact: Contact, done: Callable[[Any], None]) -> None:
        if not src.alive:
            return
        src.routing.mark_failed(contact.peer_id, contact.addr)
        done(_FAILED)

    def _lost(self) -> bool:
        return self.net.loss > 0 and self.rng.random() < self.net.loss

    def _latency(self, a: SimNode, b: SimNode) -> float:
        return (a.access + b.access) * (1 + self.net.jitter * self.rng.random())

    # ------------------------------------------------------------------ membership

    def add_node(self) -> SimNode:
        """A new node, not yet joined (``join`` it)."""
        index = len(self.nodes)
        identity = Identity(Ed25519PrivateKey.from_private_bytes(self.rng.randbytes(32)))
        addr = (f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}", 4000 + (index >> 24))
        access = self.net.latency_median * math.exp(self.net.latency_sigma * self.rng.gauss(0, 1))
        node = SimNode(self, identity, addr, access)
        self.nodes.append(node)
        self.by_addr[addr] = node
        return node

    def join(self, node: SimNode, done: Callable[[SimNode], None] | None = None) -> None:
        """``DHTNode.start``: ping a bootstrap peer (another if it fails), look ourselves up (twice
        if no one answered), and start the upkeep rounds (the first refreshes every bucket the
        join left untouched)."""
        boot = self._any_live()
        if boot is None:  # the first node
            self._joined(node, done)
            return

        def pinged(reply: Any) -> None:
            if reply is _FAILED:
                self.loop.call_at(self.loop.now + 1.0, self.join, node, done)
            else:
                node.lookup(node.node_id, "find_node", node.node_id, looked_up)

        def looked_up(result: SimLookup, again: bool = True) -> None:
            if not result.closest and again:
                node.lookup(node.node_id, "find_node", node.node_id, lambda r: looked_up(r, False))
            else:
                self._joined(node, done)

        self.call(node, boot.contact_self, "ping", None, pinged)

    def _joined(self, node: SimNode, done: Callable[[SimNode], None] | None) -> None:
        node.joined = True
        node.next_republish = self.loop.now + self.config.republish_interval * node.rng.uniform(0.75, 1.25)
        self.loop.call_at(self.loop.now + self.config.maintenance_period, node.tick)
        if done is not None:
            done(node)

    def grow(self, count: int, spacing: float = 0.05) -> None:
        """Add ``count`` nodes, one joining every ``spacing`` seconds, and run until all joined."""
        left = [count]

        def joined(_: SimNode) -> None:
            left[0] -= 1

        start = self.loop.now
        for i in range(count):
            self.loop.call_at(start + i * spacing, self.join, self.add_node(), joined)
        self.loop.run(done=lambda: left[0] == 0)

    def kill(self, fraction: float) -> list[SimNode]:
        """Kill that fraction of the live nodes, chosen at random, at once (a SIGKILL: no goodbye)."""
        live = self.live()
        dead = self.rng.sample(live, round(fraction * len(live)))
        for node in dead:
            node.alive = False
        return dead

    # ------------------------------------------------------------------ workloads

    def store_many(self, count: int, ttl: float = 7200.0) -> list[tuple[bytes, bytes]]:
        """``count`` plain values, each stored by a random live node; runs until all are replicated."""
        items = [(b"key-%d" % i, b"value-%d" % i) for i in range(count)]
        left = [count]

        def stored(_: int) -> None:
            left[0] -= 1

        live = self.live()
        for key, value in items:
            self.rng.choice(live).store(key, value, ttl, stored)
        self.loop.run(done=lambda: left[0] == 0)
        return items

    def get_many(self, items: list[tuple[bytes, bytes]], count: int, latest: bool = False) -> GetStats:
        """``count`` gets of stored items, each from a random live node; runs until all answer.
        A get succeeds when it finds the value that was stored."""
        stats = GetStats(asked=count, succeeded=0, hops=[], latency=[])
        left = [count]
        live = self.live()

        def got(value: bytes, result: SimLookup) -> None:
            left[0] -= 1
            stats.queried += result.queried
            if any(r.value == value for r in result.records):
                stats.succeeded += 1
                stats.hops.append(result.hops)
                stats.latency.append(result.ended - result.started)

        for _ in range(count):
            key, value = self.rng.choice(items)
            self.rng.choice(live).get(key, lambda result, v=value: got(v, result), latest)
        self.loop.run(done=lambda: left[0] == 0)
        return stats

    def run_for(self, seconds: float) -> None:
        """Let time pass (upkeep rounds: refreshes and republishing)."""
        self.loop.run(until=self.loop.now + seconds)
