"""Matchmaking: peers that average under the same key meet through the DHT and form groups.

One round, seen from one peer (``Matchmaker.form_group``):

1. **Register.** Write an owner-signed sub-key under ``{prefix}/avg/{schema hash}/{round}`` with our
   member info (peer id, address or None for client mode, bandwidth), our arrival time and how long
   we wait; and our schema summary under ``{prefix}/avg/schemas/{round}``. The schema hash is in the
   key, so peers with another model or codec never see us as a candidate; the summaries only serve
   to *explain* such a mismatch (a warning, once per peer, and ``mismatches()``). The entry goes out
   in the background, at once to the key's holders as our routing table knows them (no lookup
   first: it lands half a round trip later), and to any others a full lookup then finds (none
   where we know fewer peers than a key's 8 holders: they all are, and we are one); and to the
   caller's ``mates``, the peers it expects in our group (a mixing-grid cell's others), which in a
   large swarm hold no copy: it lands on their nodes, where their gathers watch for it.
2. **Gather.** Read the key every 50 ms, backing off, reads overlapping (up to 4 in flight: on a
   slow link a read that just missed the others' entries must not cost a whole round trip more);
   the first asks every holder we know, later ones 2 of them. Once it answered (or at once, when
   they hold every peer expected), entries written to our own node (a holder of the key, as every
   peer of a small swarm is, or a mate) count as they land, without a read (reads still find those
   of writers that do not know us yet).
   Stop once at least ``min_group_size`` peers are present and the set has not grown for the
   *settle window* ``max(100 ms, 3 x measured DHT read latency, 2 x mean gap between the recent
   arrivals)`` (capped at a fifth of the timeout), or at once when the caller's ``expected`` peers
   are all there. While some of those are missing the window is at least the *grace*: 1.5 x the
   widest arrival spread of our recent rounds (stragglers seen after we grouped included), at least
   0.5 s, at most a third of the timeout. Also stop as soon as another peer's join reaches us (it
   has settled already) unless peers we expect are missing (its view may be staler than ours), or
   when only the time to hand the group over is left before the deadline.
3. **Plan.** Every peer splits what it saw the same way (``plan_groups``): members sorted by
   ``blake2b(peer id | round key)``, peers with an address first, dealt round-robin into
   ``ceil(n / target)`` groups, so sizes differ by at most one (40 peers, target 16: 14+13+13).
   The first member of each group, a peer with an address, leads it.
4. **Join.** A member calls ``p2ptrain.mm.join`` on its leader and the call stays open until the
   leader closes the group and answers with it (``Group.to_wire()``: random 16-byte id, the
   leader first, the others by the same hash). A joiner names the others it planned with it, and the
   leader expects them too (its own view may have missed one). A leader closes as soon as every
   member it expects has joined or the group is full, else after ``max(500 ms, 2 x settle, 6 x latency)``, and
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

The pieces: ``plan.py`` (sans-IO: order, plan, settle window), ``board.py`` (the DHT entries),
``join.py`` (lead, follow, the join handler), ``mm_state.py`` (a round's state at one peer).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from dht import Contact, DHTNode, PeerID, TaskGroup

from ..addresses import Reach
from .board import Board
from .claims import Entry
from .group import Group, Member
from .join import JoinDispatcher, JoinProtocol
from .mm_state import MatchRound
from .plan import MAX_ROUND_ID, Gathered, expected_grace, gather_verdict, settle_window
from .schema import Schema

log = logging.getLogger("p2ptrain.matchmaking")

_FIRST_POLL = 0.05  # s: the first read period, backed off x1.5 while nothing changes
_MAX_POLL = 0.5
_KEPT_ROUNDS = 16  # finished rounds remembered, to answer late joins clearly
_READS_IN_FLIGHT = 4  # overlapping polls of the round's key
_SPREAD_ROUNDS = 16  # recent rounds whose arrival spread sets the wait for expected peers
_SCHEMA_CHECK_EVERY = 32  # polls between reads of the round's schema summaries (the first poll reads them)


class Matchmaker(JoinProtocol):
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
        self._rounds: OrderedDict[str, MatchRound] = OrderedDict()
        self._spreads: deque[float] = deque(maxlen=_SPREAD_ROUNDS)  # first to last arrival of recent rounds, s
        self._tasks = TaskGroup("matchmaker", log=log)  # the board's writes and reads
        self._closed = False
        self.board = Board(node, prefix, schema, self._tasks.spawn)
        self.last_stats: dict[str, Any] = {}
        JoinDispatcher.register(node.host, self)

    # ------------------------------------------------------------------ public

    @property
    def latency(self) -> float:
        return self.board.latency

    def me(self, weight: float | None = None) -> Member:
        """Our member info, declaring ``weight`` (samples of this round) when given."""
        reach = Reach()
        if not self.client_mode:
            reach = Reach.of_node(self.node)
            if not reach and self.node.host.reachable:
                raise RuntimeError("the DHT node is not listening yet: start() it before forming groups")
            # behind NAT without a relay yet: nobody can dial us, so this round we take part as a client
        return Member(self.node.peer_id, reach.addr, self.bandwidth, weight, reach.relays)

    def round_key(self, round_id: str | int) -> str:
        return self.board.round_key(round_id)

    def schemas_key(self, round_id: str | int) -> str:
        return self.board.schemas_key(round_id)

    def mismatches(self) -> dict[str, str]:
        """Peer id (base58) -> a sentence explaining how its schema differs from ours."""
        return self.board.mismatches()

    async def close(self) -> None:
        self._closed = self.board.closed = True
        JoinDispatcher.unregister(self.node.host, self)
        for rnd in self._rounds.values():
            if rnd.lead is not None and rnd.lead.done is not None and not rnd.lead.done.done():
                rnd.lead.done.set_result(None)
            rnd.set_state("done")
        await self._tasks.close()

    async def __aenter__(self) -> Matchmaker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def form_group(self, round_id: str | int, timeout: float, expected: int | None = None,
                         min_size: int | None = None, weight: float | None = None,
                         mates: Sequence[Contact] = ()) -> Group:
        """Meet the peers averaging the same round and schema; at most ``timeout`` seconds.

        ``expected``: how many peers (us included) the caller knows will come, e.g. from the
        training progress in the DHT. Once that many are seen the gather stops at once instead of
        waiting out the settle window, which is most of a round's matchmaking time on a quiet swarm.
        ``min_size``: this round's smallest acceptable group (default ``min_group_size``; at most
        ``target_group_size``): a peer that cannot join one that large returns a group of itself.
        ``weight``: the samples we will average with, declared in our entry (``group.weight_cap``).
        ``mates``: peers the caller expects in our group (a cell of the mixing grid): our entry goes
        to them too, besides the key's holders, so that it lands where they watch for it.
        """
        if self._closed:
            raise RuntimeError("matchmaker is closed")
        round_id = str(round_id)
        if not round_id or len(round_id) > MAX_ROUND_ID:
            raise ValueError(f"round id must be 1 to {MAX_ROUND_ID} characters")
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
        self._note_spreads()
        rnd = MatchRound(round_id, self.round_key(round_id), least, timeout)
        rnd.mates = [c for c in mates if c.peer_id != me.peer_id and c.dialable]
        self._rounds[round_id] = rnd
        self._rounds.move_to_end(round_id)
        while len(self._rounds) > _KEPT_ROUNDS:
            self._rounds.popitem(last=False)
        group: Group | None = None
        attempts = 0
        try:
            # A safety net only: every wait below already ends before the deadline.
            async with asyncio.timeout_at(deadline + 0.25):
                self.board.register(rnd, me, timeout, deadline)
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
            if not self._closed:  # (a closed board writes nothing)
                self._tasks.spawn(self.board.mark_done(rnd))
            now = loop.time()
            self.last_stats = {
                "round": round_id, "group_size": group.size, "seconds": now - started,
                "attempts": attempts, "dht_latency": self.latency, "marks": dict(rnd.marks),
                "started": time.time() - (now - started),
            }
        if group.size == 1:
            log.info("round %s: nobody to average with within %.1f s; keeping our own tensors", round_id, timeout)
        return group

    # ------------------------------------------------------------------ steps

    async def _gather(self, rnd: MatchRound, me: Member, timeout: float, deadline: float,
                      failed: set[PeerID], expected: int | None = None) -> list[Member] | None:
        """Poll the round's key until the set of candidates settles; None at the deadline alone.

        Reads overlap (one starts every poll period, up to ``_READS_IN_FLIGHT`` at once): on a slow
        link a poll takes a round trip, and a read that just missed an entry must not cost another.
        Entries that land at our own node (a holder of the key, as every peer of a small swarm is)
        count at once, half a round trip before a read would bring them; the first decision waits
        for the first read all the same."""
        loop = asyncio.get_running_loop()
        rnd.lead, rnd.redirect = None, None
        rnd.join_hint.clear()
        rnd.set_state("gathering")
        period = _FIRST_POLL
        last_growth = next_read = loop.time()
        candidates: dict[PeerID, Entry] = {}  # every peer seen as a candidate during this gather
        finished: set[PeerID] = set()  # peers seen done (grouped already, or gave up)
        schema_task: asyncio.Task | None = None
        reads: set[asyncio.Task] = set()
        polls = answered = 0
        wake_at = deadline
        grace = expected_grace(self._spreads, self.latency, timeout)
        with self.node.watch(rnd.key) as landed:
            landed.set()  # (the entries of the peers that came before us may be here already)
            try:
                while True:
                    now = loop.time()
                    if now >= next_read and len(reads) < _READS_IN_FLIGHT:
                        if self._closed:
                            return None
                        # (again a few polls on while nobody is seen: the first read may have come
                        # before the others' summaries landed)
                        check = polls % _SCHEMA_CHECK_EVERY == 0 or (polls == 3 and not candidates)
                        if check and (schema_task is None or schema_task.done()):
                            schema_task = self._tasks.spawn(self.board.check_schemas(rnd, deadline))
                        polls += 1
                        reads.add(self._tasks.spawn(self.board.read(rnd, deadline), awaited=True))
                        next_read = now + period
                        period = min(period * 1.5, _MAX_POLL, max(rnd.settle / 2, _FIRST_POLL))
                        if expected is not None and len(candidates) + 1 < expected and now - last_growth < 1.0:
                            # the expected stragglers are near: see the next one a poll after it lands
                            # (no faster than reads come back: a loaded swarm is not polled harder)
                            period = max(_FIRST_POLL, self.latency)
                    # (an event already set is not waited on again: that would return at once and spin)
                    events = [e for e in (rnd.join_hint, landed) if not e.is_set()]
                    timer = wake_at if len(reads) >= _READS_IN_FLIGHT else min(next_read, wake_at)
                    wait = 0.0 if landed.is_set() else max(0.0, timer - loop.time())
                    done = await _first_of(reads, events, wait)
                    reads -= done
                    now, now_wall = loop.time(), time.time()
                    views = [task.result() for task in done]
                    answered += len(views)
                    if landed.is_set():
                        landed.clear()
                        views.append(self.board.local(rnd))
                    grew = False
                    for entries in views:
                        rnd.registered.update((p, e.member) for p, e in entries.items())
                        for peer, entry in entries.items():
                            rnd.arrivals[peer] = entry.arrived
                            if peer == me.peer_id:
                                continue
                            if entry.done:  # grouped already, or gave up (records expire shortly after)
                                finished.add(peer)
                                # Peers we saw as candidates stay in the view while it settles, so that
                                # every peer plans over the same set even after the first groups closed.
                                continue
                            if peer in failed:  # (counted above when done: a refusing leader is done)
                                continue
                            grew = grew or peer not in candidates
                            candidates[peer] = entry
                    if grew:
                        last_growth = now
                        period = max(_FIRST_POLL, self.latency)
                        next_read = min(next_read, now + period)
                    n = len(candidates) + 1
                    if not answered and (expected is None or n < expected):
                        # (``expected`` comes from a view of the swarm up to a refresh old: a read of the
                        # holders, a round trip, also finds peers that came with us, whom it may miss)
                        continue
                    rnd.mark("first_read")
                    if expected is not None and n >= expected:
                        rnd.mark("all_seen")
                    arrivals = [
                        e.arrived for e in candidates.values() if now_wall - timeout - 60 <= e.arrived <= now_wall + 5
                    ] + [rnd.entry_value["t"] if rnd.entry_value else now_wall]
                    rnd.settle = settle_window(self.latency, arrivals, timeout)
                    seen = Gathered(n=n, min_size=rnd.min_size, expected=expected, finished=len(finished),
                                    last_growth=last_growth, settle=rnd.settle, grace=grace,
                                    reserve=min(max(0.1, 4 * self.latency), 0.3 * timeout), deadline=deadline,
                                    joined=rnd.join_hint.is_set())
                    verdict, wake_at = gather_verdict(seen, now)
                    if verdict == "plan":
                        log.debug("round %s: gathered %d peers in %d polls (settle %.3f s, latency %.3f s%s)",
                                  rnd.round_id, n, polls, rnd.settle, self.latency,
                                  ", joined by a peer" if rnd.join_hint.is_set() else "")
                        rnd.mark("planned")
                        return [me] + [e.member for e in candidates.values()]
                    if verdict == "alone":
                        log.debug("round %s: nobody to meet (%d of %d peers seen, %d others done)",
                                  rnd.round_id, n, rnd.min_size, len(finished))
                        return None
            finally:
                for task in reads:
                    task.cancel()

    def _note_spreads(self) -> None:
        """The arrival spread of each finished round not yet counted: the entries its gathers saw and
        those our node holds now, stragglers that came after we grouped included."""
        for rnd in self._rounds.values():
            if rnd.state != "done" or rnd.spread_noted:
                continue
            rnd.spread_noted = True
            arrivals = dict(rnd.arrivals)
            arrivals.update((p, e.arrived) for p, e in self.board.local(rnd).items())
            if len(arrivals) > 1:
                self._spreads.append(min(max(arrivals.values()) - min(arrivals.values()), rnd.timeout))


async def _first_of(tasks: set[asyncio.Task], events: list[asyncio.Event], timeout: float) -> set[asyncio.Task]:
    """Wait until one of ``tasks`` is done, one of ``events`` is set or ``timeout`` passed; the tasks done."""
    waiters = {asyncio.ensure_future(event.wait()) for event in events}
    waiting = tasks | waiters
    try:
        if waiting:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(timeout)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return {t for t in tasks if t.done()}
