"""Matchmaking: peers that average under the same key meet through the DHT and form groups.

One round, seen from one peer (``Matchmaker.form_group``):

1. **Register.** Write an owner-signed sub-key under ``{prefix}/avg/{schema hash}/{round}`` with our
   member info (peer id, address or None for client mode, bandwidth), our arrival time and how long
   we wait; and our schema summary under ``{prefix}/avg/schemas/{round}``. The schema hash is in the
   key, so peers with another model or codec never see us as a candidate; the summaries only serve
   to *explain* such a mismatch (a warning, once per peer, and ``mismatches()``). The entry goes out
   in the background, to the holders the first read of step 2 finds: no lookup of its own, and no
   waiting for it before gathering (a round trip less per round on a slow link).
2. **Gather.** Read the key every 50 ms, backing off (the first read is a full ``latest`` lookup;
   later ones ask 3 of the holders it found directly), and stop once at least
   ``min_group_size`` peers are present and the set has not grown for the *settle window*
   ``max(100 ms, 3 x measured DHT read latency, 2 x mean gap between the recent arrivals)``
   (capped at a fifth of the timeout; at least 0.5 s, or a tenth of the timeout, while fewer
   peers than the caller's ``expected`` are there), or as soon as another peer's join reaches us (it has
   settled already), or when only the time to hand the group over is left before the deadline.
3. **Plan.** Every peer splits what it saw the same way (``plan_groups``): members sorted by
   ``blake2b(peer id | round key)``, peers with an address first, dealt round-robin into
   ``ceil(n / target)`` groups, so sizes differ by at most one (40 peers, target 16: 14+13+13).
   The first member of each group, a peer with an address, leads it.
4. **Join.** A member calls ``p2ptrain.mm.join`` on its leader and the call stays open until the
   leader closes the group and answers with it (``Group.to_wire()``: random 16-byte id, the
   leader first, the others by the same hash). A leader closes as soon as every member it expects
   has joined or the group is full, else after ``max(500 ms, 2 x settle, 6 x latency)``, and
   always before the earliest joiner's own deadline. A joiner that goes away before that is
   dropped from the group.
   Once in a group (or given up) a peer re-writes its entry as done, so that late arrivals do not
   count on it; peers seen as candidates stay in the view of a gather, so that a group closing
   early does not change the plan of the peers still settling.
5. **Fall back.** A leader that is dead, refuses, or is itself following someone else (it then
   redirects) makes the joiner follow the redirect or read the DHT again without that leader
   and retry; a peer that finds nobody returns a group of itself at its deadline.

Everything read from the DHT or a join is validated (signature, owner, schema of the value,
sizes); malformed entries are skipped, a join with another schema gets an error that says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dht import DHTError, DHTNode, Host, InvalidRecord, PeerID, ProtocolError
from dht.aio import cancel_all, wait_event
from dht.routing import Contact
from dht.storage import Record, owned_name, record_owner, validate_record
from dht.wire import unpack

from .claims import VERSION as _VERSION
from .claims import Entry, join_reply_group, parse_entry, verify_group
from .group import Group, Member
from .schema import Schema, parse_summary, schema_mismatch_message

log = logging.getLogger("p2ptrain.matchmaking")

JOIN_METHOD = "p2ptrain.mm.join"
_MEMBER_SUBKEY = b"m"
_MAX_ENTRY_BYTES = 4096
_MAX_SUMMARY_BYTES = 16 * 1024
_MAX_ROUND_ID = 200
_FIRST_POLL = 0.05  # s: the first read period, backed off x1.5 while nothing changes
_MAX_POLL = 0.5
_MIN_SETTLE = 0.1
#: How long a leader waits, at least, for the members it planned (it closes at once when all have
#: joined, so this only costs time when one of them vanished). It covers one lost packet of a join:
#: TCP's minimum retransmission timeout is 200 ms, and members end gathering up to a few read
#: latencies apart. At 0.2 s, 4 hosts on 1%-loss links split a round (3 + 1) in 3 of 65 trials: the
#: last member's join came after the leader had closed.
_MIN_LEAD_WINDOW = 0.5
_LINGER = 2.0  # s: our entry outlives our deadline by this much
_KEPT_ROUNDS = 16  # finished rounds remembered, to answer late joins clearly
_READ_FANOUT = 3  # holders asked per poll once a full lookup has found them
_FULL_LOOKUP_EVERY = 16  # polls between full lookups (new holders, dead ones replaced)
_MAX_RECORDS = 1000


# ---------------------------------------------------------------------------- sans-IO helpers


def score(peer: PeerID, round_key: str) -> int:
    """The deterministic order of peers in one round (fresh for every round)."""
    digest = hashlib.blake2b(peer.to_bytes() + b"|" + round_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def plan_groups(members: Iterable[Member], round_key: str, target: int) -> list[list[Member]]:
    """Split ``members`` into balanced groups of at most about ``target``; each starts with its
    leader, a member with an address. Every peer computes the same plan from the same set.

    Peers with an address come first (sorted by ``score``), then client-mode peers, dealt
    round-robin into ``ceil(n / target)`` groups (fewer when there are fewer possible leaders):
    group sizes differ by at most one and every group gets a leader. Client-mode peers beyond
    what the leaders can take (``target`` each) are left out.
    """
    if target < 1:
        raise ValueError("target group size must be at least 1")
    unique = {m.peer_id: m for m in members}
    servers = sorted((m for m in unique.values() if m.addr is not None), key=lambda m: score(m.peer_id, round_key))
    clients = sorted((m for m in unique.values() if m.addr is None), key=lambda m: score(m.peer_id, round_key))
    if not servers:
        return []
    ordered = (servers + clients)[: len(servers) * target]
    n_groups = min(math.ceil(len(ordered) / target), len(servers))
    groups: list[list[Member]] = [[] for _ in range(n_groups)]
    for i, member in enumerate(ordered):
        groups[i % n_groups].append(member)
    return groups


#: the settle window's floor while ``expected`` peers are not all there yet (see _gather)
_EXPECTED_GRACE = 0.5


def settle_window(latency: float, arrivals: Iterable[float], timeout: float) -> float:
    """How long the set of registered peers must stay unchanged before we stop gathering.

    ``max(100 ms, 3 x DHT read latency, 2 x mean gap between the last 8 arrivals)``: quick when
    everyone arrives at once on a fast network, patient when peers trickle in; capped at a fifth
    of the timeout so that a hostile arrival time cannot make us wait long.
    """
    window = max(_MIN_SETTLE, 3.0 * latency)
    recent = sorted(arrivals)[-8:]
    if len(recent) >= 2:
        window = max(window, 2.0 * (recent[-1] - recent[0]) / (len(recent) - 1))
    return min(window, max(_MIN_SETTLE, 0.2 * timeout))


# ---------------------------------------------------------------------------- per-round state


@dataclass
class _Lead:
    expected: set[PeerID]
    opened_at: float  # loop time
    close_at: float
    joined: dict[PeerID, Member] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future | None = None  # -> Group, or None when it closed too small
    closed: bool = False


class _Round:
    def __init__(self, round_id: str, key: str, min_size: int):
        self.round_id = round_id
        self.key = key
        self.min_size = min_size  # the smallest group this round may form (else: alone)
        self.state = "gathering"  # gathering | leading | following | done
        self.changed = asyncio.Event()
        self.join_hint = asyncio.Event()
        self.lead: _Lead | None = None
        self.redirect: Member | None = None
        self.group: Group | None = None
        self.entry_value: dict | None = None
        self.entry_expiration = 0.0
        self.verified: dict[tuple, Entry | None] = {}  # record fields -> parsed entry (checked once)
        self.registered: dict[PeerID, Member] = {}  # each peer as it registered (claims.verify_group)
        self.settle = _MIN_SETTLE  # the last settle window used while gathering
        self.holders: list[Contact] = []  # peers that store the round's key (from the last lookup)
        self.reads = 0
        self.first_read = asyncio.Event()  # our entry is written once the first read found the holders

    def set_state(self, state: str) -> None:
        self.state = state
        event, self.changed = self.changed, asyncio.Event()
        event.set()


class _Dispatcher:
    """Routes join calls arriving at one host to the Matchmaker of their prefix."""

    _by_host: weakref.WeakKeyDictionary[Host, _Dispatcher] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.matchmakers: dict[str, Matchmaker] = {}

    @classmethod
    def register(cls, host: Host, mm: Matchmaker) -> None:
        disp = cls._by_host.get(host)
        if disp is None:
            disp = cls._by_host[host] = cls()
            host.on_request(JOIN_METHOD, disp.on_join)
        if mm.prefix in disp.matchmakers and disp.matchmakers[mm.prefix] is not mm:
            raise ValueError(f"this node already runs a Matchmaker for {mm.prefix!r}")
        disp.matchmakers[mm.prefix] = mm

    @classmethod
    def unregister(cls, host: Host, mm: Matchmaker) -> None:
        disp = cls._by_host.get(host)
        if disp is not None and disp.matchmakers.get(mm.prefix) is mm:
            del disp.matchmakers[mm.prefix]

    async def on_join(self, conn: Any, args: Any) -> Any:
        if not isinstance(args, dict) or not isinstance(args.get("prefix"), str):
            raise ValueError("malformed join request")
        mm = self.matchmakers.get(args["prefix"])
        if mm is None:
            raise ValueError(f"this peer does not average {args['prefix'][:100]!r}")
        return await mm._on_join(conn, args)


# ---------------------------------------------------------------------------- the matchmaker


class Matchmaker:
    """Forms averaging groups for one run (``prefix``) and one tensor schema over a DHT node.

    ``form_group(round_id, timeout)`` returns a :class:`Group` that every member receives
    identically (same id, same order), or a group of just this peer when nobody else showed up
    in time; it never waits past ``timeout``. ``client_mode`` (default: the node's) peers join
    groups but never lead one. ``close()`` cancels every task this object owns.
    """

    def __init__(
        self,
        node: DHTNode,
        prefix: str,
        schema: Schema,
        target_group_size: int = 16,
        min_group_size: int = 2,
        bandwidth: float = 1.0,
        client_mode: bool | None = None,
    ):
        if not isinstance(prefix, str) or not prefix or len(prefix) > 200:
            raise ValueError("prefix must be a non-empty string of at most 200 characters")
        if target_group_size < 1 or min_group_size < 1:
            raise ValueError("group sizes must be at least 1")
        if min_group_size > target_group_size:
            raise ValueError(f"min_group_size {min_group_size} exceeds target_group_size {target_group_size}")
        if not (0 <= bandwidth < 1e15):
            raise ValueError("bandwidth must be a non-negative number")
        if client_mode is False and node.client_mode:
            raise ValueError("a node started without listen address can only take part in client mode")
        self.node = node
        self.prefix = prefix
        self.schema = schema
        self.target_group_size = target_group_size
        self.min_group_size = min_group_size
        self.bandwidth = float(bandwidth)
        self.client_mode = node.client_mode if client_mode is None else client_mode
        self._rounds: OrderedDict[str, _Round] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._mismatches: dict[str, str] = {}
        self._latency: float | None = None  # EWMA of DHT read latency, seconds
        self._closed = False
        self.last_stats: dict[str, Any] = {}
        _Dispatcher.register(node.host, self)

    # ------------------------------------------------------------------ public

    @property
    def latency(self) -> float:
        return self._latency if self._latency is not None else 0.02

    def me(self, weight: float | None = None) -> Member:
        """Our member info, declaring ``weight`` (samples of this round) when given."""
        addr = None
        if not self.client_mode:
            addrs = self.node.multiaddrs
            if not addrs:
                raise RuntimeError("the DHT node is not listening yet: start() it before forming groups")
            addr = (addrs[0].host, addrs[0].port)
        return Member(self.node.peer_id, addr, self.bandwidth, weight)

    def round_key(self, round_id: str | int) -> str:
        return f"{self.prefix}/avg/{self.schema.hash}/{round_id}"

    def schemas_key(self, round_id: str | int) -> str:
        return f"{self.prefix}/avg/schemas/{round_id}"

    def mismatches(self) -> dict[str, str]:
        """Peer id (base58) -> a sentence explaining how its schema differs from ours."""
        return dict(self._mismatches)

    async def close(self) -> None:
        self._closed = True
        _Dispatcher.unregister(self.node.host, self)
        for rnd in self._rounds.values():
            if rnd.lead is not None and rnd.lead.done is not None and not rnd.lead.done.done():
                rnd.lead.done.set_result(None)
            rnd.set_state("done")
        await cancel_all(self._tasks)

    async def __aenter__(self) -> Matchmaker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def form_group(self, round_id: str | int, timeout: float, expected: int | None = None,
                         min_size: int | None = None, weight: float | None = None) -> Group:
        """Meet the peers averaging the same round and schema; at most ``timeout`` seconds.

        ``expected``: how many peers (us included) the caller knows will come, e.g. from the
        training progress in the DHT. Once that many are seen the gather stops at once instead of
        waiting out the settle window, which is most of a round's matchmaking time on a quiet swarm.
        ``min_size``: this round's smallest acceptable group (default ``min_group_size``; at most
        ``target_group_size``): a peer that cannot join one that large returns a group of itself.
        ``weight``: the samples we will average with, declared in our entry (``group.weight_cap``).
        """
        if self._closed:
            raise RuntimeError("matchmaker is closed")
        round_id = str(round_id)
        if not round_id or len(round_id) > _MAX_ROUND_ID:
            raise ValueError(f"round id must be 1 to {_MAX_ROUND_ID} characters")
        if not timeout > 0:
            raise ValueError("timeout must be positive")
        existing = self._rounds.get(round_id)
        if existing is not None and existing.state != "done":
            raise RuntimeError(f"already forming a group for round {round_id!r}")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        me = self.me(weight)
        least = self.min_group_size if min_size is None else max(1, min(min_size, self.target_group_size))
        rnd = _Round(round_id, self.round_key(round_id), least)
        self._rounds[round_id] = rnd
        self._rounds.move_to_end(round_id)
        while len(self._rounds) > _KEPT_ROUNDS:
            self._rounds.popitem(last=False)
        group: Group | None = None
        attempts = 0
        try:
            # A safety net only: every wait below already ends before the deadline.
            async with asyncio.timeout_at(deadline + 0.25):
                self._register(rnd, me, timeout, deadline)
                failed: set[PeerID] = set()
                while group is None and loop.time() < deadline:
                    view = await self._gather(rnd, me, timeout, deadline, failed, expected)
                    if view is None:
                        break
                    attempts += 1
                    group = await self._attempt(rnd, me, view, timeout, deadline, failed)
        except TimeoutError:
            log.warning("matchmaking for round %s overran its deadline; averaging alone", round_id)
        finally:
            if group is None:
                group = Group(os.urandom(16), (me,))
            rnd.group = group
            if rnd.lead is not None and rnd.lead.done is not None and not rnd.lead.done.done():
                rnd.lead.done.set_result(None)
            rnd.set_state("done")
            self._spawn(self._mark_done(rnd))
            self.last_stats = {
                "round": round_id, "group_size": group.size, "seconds": loop.time() - started,
                "attempts": attempts, "dht_latency": self.latency,
            }
        if group.size == 1:
            log.info("round %s: nobody to average with within %.1f s; keeping our own tensors", round_id, timeout)
        return group

    # ------------------------------------------------------------------ steps

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _register(self, rnd: _Round, me: Member, timeout: float, deadline: float) -> None:
        """Write our entry for the round, in the background: at the key's holders that our first
        read finds (that read is a full lookup of the key), so the entry lands one round trip after
        the read instead of after a lookup of its own. Gathering does not wait for it: we count
        ourselves in any case, and the others see us once it lands (4 peers on 100 ms RTT links:
        0.43 s of matchmaking per round before, 0.37 s after; ``benchmarks/utilisation.py --netem``)."""
        now_wall = time.time()
        rnd.entry_value = {"v": _VERSION, "m": me.to_wire(), "t": now_wall, "w": float(timeout), "d": False}
        rnd.entry_expiration = now_wall + timeout + _LINGER
        subkey = self.node.owned(_MEMBER_SUBKEY.decode())
        # The schema summary only explains mismatches: publish it without waiting for it.
        self._spawn(self._publish_summary(rnd, subkey))
        self._spawn(self._store_entry(rnd, subkey, deadline))

    async def _store_entry(self, rnd: _Round, subkey: str, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            async with asyncio.timeout_at(deadline):
                await rnd.first_read.wait()
                if rnd.state == "done":
                    return  # over before the first read came back: _mark_done writes what is left
                await self.node.store(rnd.key, rnd.entry_value, rnd.entry_expiration, subkey=subkey,
                                      closest=rnd.holders or None)
            log.debug("round %s: registered in %.3f s", rnd.round_id, loop.time() - t0)
        except TimeoutError:
            return
        except DHTError as e:
            log.warning("could not register for round %s: %s", rnd.round_id, e)

    async def _publish_summary(self, rnd: _Round, subkey: str) -> None:
        try:
            await self.node.store(self.schemas_key(rnd.round_id), self.schema.summary(), rnd.entry_expiration,
                                  subkey=subkey)
        except DHTError as e:
            log.debug("could not publish our schema summary for round %s: %s", rnd.round_id, e)

    async def _mark_done(self, rnd: _Round) -> None:
        """Tell peers still gathering that we are no longer a candidate (best effort)."""
        if rnd.entry_value is None or self._closed:
            return
        value = dict(rnd.entry_value, d=True)
        rnd.entry_expiration = max(rnd.entry_expiration, time.time() + 1.0) + 0.001
        try:
            await self.node.store(rnd.key, value, rnd.entry_expiration, subkey=self.node.owned(_MEMBER_SUBKEY.decode()))
        except DHTError:
            pass

    async def _records(self, key: str, holders: list[Contact], deadline: float) -> tuple[list[Record], list[Contact]]:
        """The records under ``key`` and the peers that hold them.

        With no ``holders`` known this is a full DHT lookup (``latest``). Afterwards we ask
        ``_READ_FANOUT`` of the holders that lookup found, chosen at random, directly: every
        registration is replicated to all of them, so a few suffice, and a poll costs 3 RPCs
        instead of a lookup over the k closest (which overloads the holders when many peers poll).
        Records are returned unmerged: the caller validates each one before choosing.
        """
        now = time.time()
        kb = key.encode()
        if not holders:
            result = await self.node.lookup_value(kb, latest=True)
            return result.records, [c for c in result.closest if c.addr is not None]
        chosen = random.sample(holders, min(_READ_FANOUT, len(holders)))
        timeout = max(0.01, min(self.node.config.rpc_timeout, deadline - asyncio.get_running_loop().time()))

        async def ask(contact: Contact) -> list[Record]:
            reply = await self.node.host.call(contact.peer_id, contact.addr, "find_value", kb, timeout)
            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], list)):
                raise ProtocolError("malformed find_value reply")
            return [Record.from_wire(r) for r in reply[0][:_MAX_RECORDS]]

        results = await asyncio.gather(*(ask(c) for c in chosen), return_exceptions=True)
        records = list(self.node.storage.get(kb, now))
        dead = {ch.peer_id for ch, r in zip(chosen, results) if isinstance(r, BaseException)}
        alive = [c for c in holders if c.peer_id not in dead]
        for r in results:
            if isinstance(r, list):
                records.extend(r)
            elif not isinstance(r, (DHTError, InvalidRecord)):
                raise r
        if not any(isinstance(r, list) for r in results):
            alive = []  # nobody answered: look the key up afresh next time
        return records, alive

    async def _registered(self, rnd: _Round, deadline: float) -> dict[PeerID, Member]:
        return {p: e.member for p, e in (await self._read(rnd, deadline)).items()}

    async def _read(self, rnd: _Round, deadline: float) -> dict[PeerID, Entry]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if rnd.reads % _FULL_LOOKUP_EVERY == 0:
            rnd.holders = []
        rnd.reads += 1
        try:
            async with asyncio.timeout_at(deadline):
                records, rnd.holders = await self._records(rnd.key, rnd.holders, deadline)
        except (TimeoutError, DHTError):
            rnd.holders = []
            return {}
        finally:
            rnd.first_read.set()  # our entry may go out now (to the holders this read found, if any)
        elapsed = loop.time() - t0
        self._latency = elapsed if self._latency is None else 0.7 * self._latency + 0.3 * elapsed
        now_wall = time.time()
        best: dict[PeerID, tuple[float, Entry]] = {}
        for record in records:
            cache_key = (record.key, record.subkey, record.value, record.expiration, record.signature)
            if cache_key in rnd.verified:
                entry = rnd.verified[cache_key]
            else:
                entry = self._check_entry(record, now_wall)
                if len(rnd.verified) < 10_000:
                    rnd.verified[cache_key] = entry
            if entry is None or record.expiration <= now_wall:
                continue
            # validated before merging, so a forged record cannot shadow the owner's newest one
            peer = entry.member.peer_id
            if peer not in best or record.expiration > best[peer][0]:
                best[peer] = (record.expiration, entry)
        return {peer: entry for peer, (_, entry) in best.items()}

    def _check_entry(self, record: Any, now_wall: float) -> Entry | None:
        if record.subkey is None or len(record.value) > _MAX_ENTRY_BYTES:
            return None
        try:
            validate_record(record, now_wall, _MAX_ENTRY_BYTES, 1024, 86_400)
            owner = record_owner(record)
            if owner is None or record.subkey != owned_name(_MEMBER_SUBKEY, owner):
                return None
            return parse_entry(unpack(record.value, _MAX_ENTRY_BYTES), owner)
        except (InvalidRecord, ProtocolError):
            return None

    async def _check_schemas(self, rnd: _Round, deadline: float) -> None:
        """Explain (once per peer) why peers registered for this round are not candidates."""
        try:
            async with asyncio.timeout_at(deadline):
                result = await self.node.lookup_value(self.schemas_key(rnd.round_id), latest=True)
        except (TimeoutError, DHTError):
            return
        now_wall = time.time()
        for record in result.records:
            try:
                if record.subkey is None or len(record.value) > _MAX_SUMMARY_BYTES:
                    continue
                owner = record_owner(record)
                if owner is None or owner == self.node.peer_id or str(owner) in self._mismatches:
                    continue
                if record.subkey != owned_name(_MEMBER_SUBKEY, owner):
                    continue
                summary = parse_summary(unpack(record.value, _MAX_SUMMARY_BYTES))
                if summary is None or summary["hash"] == self.schema.hash:
                    continue
                validate_record(record, now_wall, _MAX_SUMMARY_BYTES, 1024, 86_400)
            except (InvalidRecord, ProtocolError):
                continue
            message = schema_mismatch_message(self.schema, unpack(record.value), peer=str(owner), run=self.prefix)
            if len(self._mismatches) < 1000:
                self._mismatches[str(owner)] = message
                log.warning("%s", message)

    async def _gather(self, rnd: _Round, me: Member, timeout: float, deadline: float,
                      failed: set[PeerID], expected: int | None = None) -> list[Member] | None:
        """Poll the round's key until the set of candidates settles; None at the deadline alone."""
        loop = asyncio.get_running_loop()
        rnd.lead, rnd.redirect = None, None
        rnd.join_hint.clear()
        rnd.set_state("gathering")
        period = _FIRST_POLL
        last_growth = loop.time()
        candidates: dict[PeerID, Entry] = {}  # every peer seen as a candidate during this gather
        schema_task: asyncio.Task | None = None
        polls = 0
        while True:
            if polls % 8 == 0 and (schema_task is None or schema_task.done()):
                schema_task = self._spawn(self._check_schemas(rnd, deadline))
            polls += 1
            entries = await self._read(rnd, deadline)
            rnd.registered.update((p, e.member) for p, e in entries.items())
            now, now_wall = loop.time(), time.time()
            grew = False
            finished = 0
            for peer, entry in entries.items():
                if peer == me.peer_id or peer in failed:
                    continue
                if entry.done:  # grouped already, or gave up (records expire shortly after)
                    finished += 1
                    # Peers we saw as candidates stay in the view while it settles, so that every
                    # peer plans over the same set even after the first groups closed.
                    continue
                grew = grew or peer not in candidates
                candidates[peer] = entry
            if grew:
                last_growth = now
                period = _FIRST_POLL
            n = len(candidates) + 1
            arrivals = [
                e.arrived for e in candidates.values() if now_wall - timeout - 60 <= e.arrived <= now_wall + 5
            ] + [rnd.entry_value["t"] if rnd.entry_value else now_wall]
            settle = rnd.settle = settle_window(self.latency, arrivals, timeout)
            if expected is not None and n < expected:
                # Peers we were told to expect are still missing: on a loaded machine a process
                # that arrives a few hundred ms after a burst of others is common, and closing
                # without it splits the round. Wait a little longer for it (bounded: it may be gone).
                settle = max(settle, min(_EXPECTED_GRACE, 0.1 * timeout))
            reserve = min(max(0.1, 4 * self.latency), 0.3 * timeout)
            view = [me] + [e.member for e in candidates.values()]
            if n >= rnd.min_size:
                everyone = expected is not None and n >= expected
                if now - last_growth >= settle or everyone or rnd.join_hint.is_set() or now >= deadline - reserve:
                    log.debug("round %s: gathered %d peers in %d polls (settle %.3f s, latency %.3f s%s)",
                              rnd.round_id, n, polls, settle, self.latency,
                              ", joined by a peer" if rnd.join_hint.is_set() else "")
                    return view
                wake_at = min(last_growth + settle, deadline - reserve)
            else:
                if now >= deadline:
                    return None
                if expected is not None and not candidates and finished + 1 >= expected:
                    # everyone we were told to expect has grouped (or given up) without us:
                    # nobody is left to meet, so do not wait out the deadline
                    log.debug("round %s: the %d other expected peers are done; nobody left", rnd.round_id, finished)
                    return None
                wake_at = deadline
            delay = max(0.0, min(period, wake_at - now))
            period = min(period * 1.5, _MAX_POLL, max(settle / 2, _FIRST_POLL))
            if rnd.join_hint.is_set():
                # A join came but we cannot act on it yet (too few peers seen: the joiner's entry
                # may still be on its way). Poll at the normal pace: waiting on the hint again would
                # return at once and spin, and with no DHT contacts a read never yields, so a stray
                # join froze this peer's event loop until the deadline.
                await asyncio.sleep(delay)
            else:
                await wait_event(rnd.join_hint, delay)

    async def _attempt(self, rnd: _Round, me: Member, view: list[Member], timeout: float,
                       deadline: float, failed: set[PeerID]) -> Group | None:
        plan = plan_groups(view, rnd.key, self.target_group_size)
        mine = next((g for g in plan if any(m.peer_id == me.peer_id for m in g)), None)
        if mine is None or len(mine) < rnd.min_size:
            await asyncio.sleep(min(_MIN_SETTLE, max(0.0, deadline - asyncio.get_running_loop().time())))
            return None
        if mine[0].peer_id == me.peer_id:
            window = max(_MIN_LEAD_WINDOW, 2 * rnd.settle, 6 * self.latency)
            return await self._lead(rnd, me, mine, window, deadline)
        return await self._follow(rnd, me, mine[0], timeout, deadline, failed)

    async def _lead(self, rnd: _Round, me: Member, planned: list[Member], window: float,
                    deadline: float) -> Group | None:
        loop = asyncio.get_running_loop()
        margin = max(0.05, 2 * self.latency)
        now = loop.time()
        lead = _Lead(expected={m.peer_id for m in planned if m.peer_id != me.peer_id}, opened_at=now,
                     close_at=min(now + window, deadline - margin))
        lead.done = loop.create_future()
        rnd.lead = lead
        rnd.set_state("leading")
        while True:
            if len(lead.joined) + 1 >= self.target_group_size or lead.expected <= set(lead.joined):
                break
            delay = lead.close_at - loop.time()
            if delay <= 0:
                break
            lead.wake.clear()
            await wait_event(lead.wake, delay)
        lead.closed = True
        log.debug("round %s: leading, closed with %d joined of %d expected (+%d unexpected)", rnd.round_id,
                  len(lead.joined), len(lead.expected), len(set(lead.joined) - lead.expected))
        members = [me] + sorted(lead.joined.values(), key=lambda m: score(m.peer_id, rnd.key))
        if len(members) < rnd.min_size:
            lead.done.set_result(None)
            rnd.lead = None
            return None
        group = Group(os.urandom(16), tuple(members))
        lead.done.set_result(group)
        return group

    async def _follow(self, rnd: _Round, me: Member, leader: Member, timeout: float, deadline: float,
                      failed: set[PeerID]) -> Group | None:
        loop = asyncio.get_running_loop()
        rnd.redirect = leader
        rnd.set_state("following")
        for _hop in range(4):
            remaining = deadline - loop.time() - 0.02
            if remaining <= 0:
                return None
            args = {
                "v": _VERSION, "prefix": self.prefix, "schema": self.schema.hash, "round": rnd.round_id,
                "member": me.to_wire(), "remaining": remaining,
            }
            try:
                reply = await self.node.host.call(leader.peer_id, leader.addr, JOIN_METHOD, args, timeout=remaining)
            except (DHTError, OSError) as e:
                log.debug("round %s: leader %s failed: %s", rnd.round_id, leader.peer_id, e)
                failed.add(leader.peer_id)
                return None
            group = join_reply_group(reply, me.peer_id, leader.peer_id)
            if group is not None:  # taken only as every member registered itself (claims.py)
                why = await verify_group(group, me, leader.peer_id, rnd.registered,
                                         lambda: self._registered(rnd, deadline), rnd.min_size, self.target_group_size)
                if why is None:
                    return group
                log.warning("round %s: refusing the group leader %s formed: %s", rnd.round_id, leader.peer_id, why)
                failed.add(leader.peer_id)
                return None
            redirect = reply.get("redirect") if isinstance(reply, dict) else None
            try:
                target = Member.from_wire(redirect) if redirect is not None else None
            except (ValueError, TypeError):
                target = None
            if target is None or target.peer_id in failed:
                reason = reply.get("refused") if isinstance(reply, dict) else None
                log.debug("round %s: %s refused us: %s", rnd.round_id, leader.peer_id, str(reason)[:200])
                failed.add(leader.peer_id)
                return None
            if target.peer_id == me.peer_id:
                # Crossed views: the peer we follow follows us. The lower score leads.
                if score(me.peer_id, rnd.key) < score(leader.peer_id, rnd.key) and not self.client_mode:
                    window = max(_MIN_LEAD_WINDOW, 6 * self.latency)
                    return await self._lead(rnd, me, [me, leader], window, deadline)
                await asyncio.sleep(max(0.02, self.latency))
                continue
            if target.addr is None:
                failed.add(leader.peer_id)
                return None
            leader = target
            rnd.redirect = leader
        return None

    # ------------------------------------------------------------------ join handler (untrusted input)

    async def _on_join(self, conn: Any, args: dict) -> Any:
        loop = asyncio.get_running_loop()
        if args.get("v") != _VERSION:
            raise ValueError("unsupported matchmaking version")
        round_id, schema_hash, remaining = args.get("round"), args.get("schema"), args.get("remaining")
        if not isinstance(round_id, str) or len(round_id) > _MAX_ROUND_ID or not isinstance(schema_hash, str):
            raise ValueError("malformed join request")
        if isinstance(remaining, bool) or not isinstance(remaining, (int, float)) or not 0 < remaining <= 86_400:
            raise ValueError("malformed join request: remaining time")
        if schema_hash != self.schema.hash:
            raise ValueError(
                f"schema mismatch: this peer averages {self.prefix!r} with schema {self.schema.hash} "
                f"({len(self.schema.tensors)} tensors, {self.schema.numel} elements, codec {self.schema.codec}), "
                f"the join is for schema {schema_hash[:32]!r}; every peer of a run must train the same model "
                "with the same codec"
            )
        member = Member.from_wire(args.get("member"))
        if conn.remote_peer is None or member.peer_id != conn.remote_peer:
            raise ValueError("join names another peer than the caller")
        joiner_deadline = loop.time() + float(remaining)
        while True:
            rnd = self._rounds.get(round_id)
            if rnd is None or self._closed:
                return {"refused": f"not matchmaking for round {round_id!r}"}
            if rnd.state == "done":
                if rnd.group is not None and rnd.group.size > 1 and member in rnd.group.members:
                    return {"group": rnd.group.to_wire()}
                return {"refused": "already in a group for this round"}
            if rnd.state == "following":
                return {"redirect": rnd.redirect.to_wire() if rnd.redirect else None,
                        "refused": "not a leader"}
            if rnd.state == "leading" and rnd.lead is not None:
                return await self._accept(rnd, rnd.lead, member, joiner_deadline)
            # Still gathering: the joiner has settled, so should we; answer once our role is known.
            rnd.join_hint.set()
            wait = joiner_deadline - loop.time()
            if wait <= 0:
                return {"refused": "too late"}
            if not await wait_event(rnd.changed, wait):
                return {"refused": "too late"}

    async def _accept(self, rnd: _Round, lead: _Lead, member: Member, joiner_deadline: float) -> Any:
        loop = asyncio.get_running_loop()
        assert lead.done is not None
        if lead.closed:
            return {"refused": "group already closed"}
        if member.peer_id not in lead.joined:
            if len(lead.joined) + 1 >= self.target_group_size:
                return {"refused": "group is full"}
            if rnd.registered.get(member.peer_id, member) != member:  # the others would refuse the group
                return {"refused": "your join differs from your registration for this round"}
            lead.joined[member.peer_id] = member
            # Close in time for this joiner to get the answer before it gives up, but not sooner
            # than half the minimum window (a joiner in a hurry is dropped, not obeyed).
            lead.close_at = min(lead.close_at, max(joiner_deadline - max(0.05, 2 * self.latency),
                                                   lead.opened_at + _MIN_LEAD_WINDOW / 2))
            lead.wake.set()
        try:
            group = await asyncio.wait_for(asyncio.shield(lead.done), max(0.0, joiner_deadline - loop.time()))
        except (asyncio.CancelledError, TimeoutError) as e:
            if not lead.done.done():  # the joiner gave up or went away: do not count it in
                lead.joined.pop(member.peer_id, None)
                lead.expected.discard(member.peer_id)
                lead.wake.set()
            if isinstance(e, asyncio.CancelledError):
                raise
            return {"refused": "the group did not close before your deadline"}
        if group is None:
            return {"refused": "too few peers joined"}
        return {"group": group.to_wire()}
