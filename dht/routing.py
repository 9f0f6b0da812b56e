"""Kademlia routing table and iterative lookup state, with no I/O.

Nothing here sends a packet or reads a clock: callers pass ``now`` and feed in responses. That keeps
the protocol logic deterministic, so it is tested by simulating hundreds of nodes in memory (the
h11 approach), and the networking layer stays a thin driver around it.

Node ids are SHA-256 of the PeerID bytes rather than the PeerID itself: Ed25519 PeerIDs share a long
constant prefix, so hashing spreads them uniformly over the 256-bit id space, as Kademlia assumes.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .identity import PeerID
from .multiaddr import Multiaddr

ID_BITS = 256


@functools.lru_cache(maxsize=1 << 16)
def node_id_of(peer_id: PeerID) -> int:
    """The position of a peer in the 256-bit id space (cached: every contact we decode needs it)."""
    return int.from_bytes(hashlib.sha256(peer_id.to_bytes()).digest(), "big")


def key_id(key: bytes) -> int:
    """The position of a record key in the id space (same hash as peers, so they are comparable)."""
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


def distance(a: int, b: int) -> int:
    """Kademlia's XOR metric."""
    return a ^ b


@dataclass(eq=False)
class Contact:
    """A peer we know of, reached at ``addr`` (its direct address) or else through ``relays`` (its
    circuit addresses, ``multiaddr.parse_circuits``). Neither: a client-mode peer, it can call us
    but not be called."""

    peer_id: PeerID
    addr: tuple[str, int] | None
    node_id: int = field(init=False)
    last_seen: float = 0.0
    failures: int = 0
    relays: tuple[Multiaddr, ...] = ()

    def __post_init__(self) -> None:
        self.node_id = node_id_of(self.peer_id)

    @property
    def dialable(self) -> bool:
        """Whether we can reach it: directly or through a relay."""
        return self.addr is not None or bool(self.relays)

    def same_addrs(self, other: Contact) -> bool:
        return self.addr == other.addr and self.relays == other.relays

    def __repr__(self) -> str:
        relayed = f", {len(self.relays)} relay(s)" if self.relays else ""
        return f"Contact({self.peer_id.short()}, {self.addr}{relayed})"


class KBucket:
    """Up to k contacts, least-recently-seen first, plus a cache of replacements.

    Kademlia prefers old contacts (long-lived peers tend to stay up), so a newcomer to a full bucket
    waits in the replacement cache and only gets a slot when a resident fails.
    """

    def __init__(self, k: int):
        self.k = k
        self.contacts: OrderedDict[PeerID, Contact] = OrderedDict()
        self.replacements: OrderedDict[PeerID, Contact] = OrderedDict()
        self.last_touched = 0.0  # 0.0 = never: a fresh table refreshes everything once

    def is_full(self) -> bool:
        return len(self.contacts) >= self.k

    def add_replacement(self, contact: Contact) -> None:
        self.replacements.pop(contact.peer_id, None)
        self.replacements[contact.peer_id] = contact  # newest last
        while len(self.replacements) > self.k:
            self.replacements.popitem(last=False)

    def remove(self, peer_id: PeerID) -> None:
        """Drop a contact and promote the most recently seen replacement into its slot."""
        self.replacements.pop(peer_id, None)
        if self.contacts.pop(peer_id, None) is not None and self.replacements:
            _, promoted = self.replacements.popitem(last=True)
            promoted.failures = 0
            self.contacts[promoted.peer_id] = promoted


class RoutingTable:
    """Contacts grouped by the length of the id prefix they share with us (one bucket per length)."""

    def __init__(self, own_id: int, k: int = 20, max_failures: int = 2, ping_after: float = 60.0):
        self.own_id = own_id
        self.k = k
        self.max_failures = max_failures
        self.ping_after = ping_after  # a contact heard from this recently needs no liveness ping
        self.buckets = [KBucket(k) for _ in range(ID_BITS)]
        self._filled: set[int] = set()  # indices of the non-empty buckets
        self._evicted: OrderedDict[PeerID, None] = OrderedDict()  # lately, for failing: see vouched

    def bucket_index(self, node_id: int) -> int:
        """Shared-prefix length with our id; ``ID_BITS`` for our own id (never stored)."""
        return ID_BITS - (self.own_id ^ node_id).bit_length()

    def _bucket_of(self, peer_id: PeerID) -> KBucket | None:
        index = self.bucket_index(node_id_of(peer_id))
        return self.buckets[index] if index < ID_BITS else None

    def update(self, contact: Contact, now: float) -> Contact | None:
        """Record that we heard from ``contact``.

        Returns the bucket's least-recently-seen contact when the bucket is full and that contact
        was not heard from within ``ping_after``: the caller should ping it and call ``remove`` if it
        does not answer (the newcomer, cached meanwhile, takes its place). Returns None otherwise.
        """
        index = self.bucket_index(contact.node_id)
        if not contact.dialable or index >= ID_BITS:
            return None
        bucket = self.buckets[index]
        self._evicted.pop(contact.peer_id, None)
        known = bucket.contacts.get(contact.peer_id)
        if known is not None:
            known.addr, known.relays, known.last_seen, known.failures = contact.addr, contact.relays, now, 0
            bucket.contacts.move_to_end(contact.peer_id)
            return None
        contact.last_seen, contact.failures = now, 0
        if not bucket.is_full():
            bucket.replacements.pop(contact.peer_id, None)
            bucket.contacts[contact.peer_id] = contact
            self._filled.add(index)
            return None
        bucket.add_replacement(contact)
        oldest = next(iter(bucket.contacts.values()))
        return oldest if now - oldest.last_seen >= self.ping_after else None

    def remove(self, peer_id: PeerID) -> None:
        """Evict a peer that failed (a liveness ping, or ``max_failures`` requests)."""
        self._evicted[peer_id] = None
        self._evicted.move_to_end(peer_id)
        if len(self._evicted) > 64 * self.k:
            self._evicted.popitem(last=False)
        index = self.bucket_index(node_id_of(peer_id))
        if index < ID_BITS:
            self.buckets[index].remove(peer_id)
            if not self.buckets[index].contacts:
                self._filled.discard(index)

    def mark_failed(self, peer_id: PeerID, addr: tuple[str, int] | None = None) -> bool:
        """Count a failed request; evict after ``max_failures`` (one timeout may be a hiccup).

        ``addr``: where the request went. A failure at another address than the one the table
        holds (say, one a third party named in a lookup reply) says nothing about the peer and
        is not counted: otherwise anyone could evict an honest peer by naming it at a dead address.
        Our last contact stays: with none, a node could never rejoin (a join whose replies were lost).
        """
        contact = self.get(peer_id)
        if contact is None or (addr is not None and addr != contact.addr):
            return False
        contact.failures += 1
        bucket = self.buckets[self.bucket_index(contact.node_id)]
        last = len(self._filled) == 1 and len(bucket.contacts) == 1 and not bucket.replacements
        if contact.failures >= self.max_failures and not last:
            self.remove(peer_id)
            return True
        return False

    def get(self, peer_id: PeerID) -> Contact | None:
        bucket = self._bucket_of(peer_id)
        return None if bucket is None else bucket.contacts.get(peer_id)

    def vouched(self, hearsay: Iterable[Contact]) -> list[Contact]:
        """Contacts a third party named (a lookup reply), each at the address this table holds for
        its peer when it holds one: that address was learnt from the peer's own connection, the
        third party's may be a lie. Peers we evicted for failing are left out until heard from
        directly: after a crash, others name the dead for a while, and each costs a lookup a query."""
        out = []
        for contact in hearsay:
            if contact.peer_id in self._evicted:
                continue
            index = self.bucket_index(contact.node_id)
            known = self.buckets[index].contacts.get(contact.peer_id) if index < ID_BITS else None
            out.append(contact if known is None or known.same_addrs(contact)
                       else Contact(contact.peer_id, known.addr, relays=known.relays))
        return out

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, PeerID) and self.get(peer_id) is not None

    def __len__(self) -> int:
        return sum(len(b.contacts) for b in self.buckets)

    def __iter__(self) -> Iterator[Contact]:
        for bucket in self.buckets:
            if bucket.contacts:
                yield from bucket.contacts.values()

    def closest(
        self, target: int, count: int, exclude: Iterable[PeerID] = frozenset(), within: int | None = None
    ) -> list[Contact]:
        """The ``count`` contacts nearest to ``target`` by exact XOR distance (only those nearer
        than ``within`` when given).

        Each bucket covers one range of distances from ``target``, disjoint from the others', so
        the buckets are taken nearest range first and only the contacts of those needed are
        sorted: this runs on every lookup and every find reply, and the table holds hundreds."""
        excluded = {node_id_of(p) for p in exclude}  # (ints: a PeerID hashes in Python)
        diff = self.own_id ^ target
        bound = 1 << ID_BITS if within is None else within
        ranges = sorted((_nearest_in_bucket(diff, i), i) for i in self._filled)
        out: list[Contact] = []
        for nearest, index in ranges:
            if nearest >= bound:
                break
            # (dict's view: an OrderedDict's own looks every key up again, a Python-level PeerID hash)
            found = [c for c in dict.values(self.buckets[index].contacts)
                     if c.node_id not in excluded and c.node_id ^ target < bound]
            found.sort(key=lambda c: c.node_id ^ target)
            out += found[: count - len(out)]
            if len(out) >= count:
                break
        return out

    def touch(self, target_id: int, now: float, found: Sequence[Contact] = ()) -> None:
        """Note a lookup into ``target_id``'s bucket, so it need not be refreshed for a while.

        ``found``: the lookup's k closest that answered. Every bucket whose whole range lies
        within the farthest of them was seen in full and counts as looked up too (a join's lookup
        of itself covers the near buckets). Hearing from a contact is no lookup: a bucket that
        traffic left half empty must still be refreshed (Kademlia's join refreshes the far ones)."""
        index = self.bucket_index(target_id)
        if index < ID_BITS:
            self.buckets[index].last_touched = now
        if len(found) < self.k:
            return
        radius = max(c.node_id ^ target_id for c in found)
        diff = self.own_id ^ target_id
        for index in range(max(self._filled, default=-1) + 1):
            # (the bucket's farthest distance is its nearest plus the width of its range, less one)
            if _nearest_in_bucket(diff, index) + (1 << (ID_BITS - 1 - index)) <= radius + 1:
                self.buckets[index].last_touched = now

    def buckets_to_refresh(self, now: float, interval: float, rng: random.Random) -> list[int]:
        """A random lookup target for each bucket not full and not looked up within ``interval``,
        up to the deepest non-empty one.

        A full bucket is kept by traffic (a newcomer gets its oldest contact pinged); deeper buckets
        cover ranges too small to hold any peer, so refreshing them is wasted work.
        """
        deepest = max(self._filled, default=-1)
        targets = []
        for index in range(deepest + 1):
            if not self.buckets[index].is_full() and now - self.buckets[index].last_touched >= interval:
                free_bits = ID_BITS - 1 - index  # bits below the first differing one
                targets.append(self.own_id ^ ((1 << free_bits) | rng.getrandbits(free_bits)))
        return targets


def _nearest_in_bucket(diff: int, index: int) -> int:
    """The smallest XOR distance to a target from any id of bucket ``index`` (``diff``: our id ^
    the target's). Its ids differ from ours first at bit ``index``, so their distances begin with
    ``diff``'s first ``index`` bits, then the opposite of its bit ``index``, then anything."""
    shift = ID_BITS - 1 - index
    return ((diff >> shift) ^ 1) << shift


_NEW, _IN_FLIGHT, _RESPONDED, _FAILED, _LATE = range(5)


class Lookup:
    """The state of one iterative, alpha-parallel Kademlia lookup for ``target``.

    The driver loops: send ``next_queries()``, feed each answer to ``on_response`` or
    ``on_failure``, until ``finished``. The lookup ends once the k closest live contacts it knows
    have all answered, which is what makes the result the true k closest with high probability.
    ``wide``: for a lookup that must hear from its whole window anyway (a ``latest`` read, whose
    window is its read quorum), every contact of the window is asked as soon as it enters it: where
    the table already holds the k closest (a swarm of a few hundred) that is one round trip instead
    of two, and one stalled peer among the alpha closest no longer holds up the rest.
    """

    def __init__(
        self,
        target: int,
        initial: list[Contact],
        k: int = 20,
        alpha: int = 3,
        own_peer: PeerID | None = None,
        wide: bool = False,
    ):
        self.target = target
        self.k = k
        self.alpha = alpha
        self.wide = wide  # every contact in the window is asked as it enters it, not alpha at a time
        self.own_peer = own_peer
        self._contacts: dict[PeerID, Contact] = {}
        self._state: dict[PeerID, int] = {}
        self._depth: dict[PeerID, int] = {}
        self._order: list[tuple[int, PeerID]] = []  # (distance, peer) sorted, failed ones removed
        self._in_flight = 0
        self._late: dict[PeerID, bool] = {}  # queries past their timeout -> whether still in the window
        self._answered = False
        self._stopped = False
        for contact in initial:
            self._add(contact, 1)

    def _add(self, contact: Contact, depth: int) -> None:
        peer = contact.peer_id
        if peer in self._contacts or peer == self.own_peer or not contact.dialable:
            return
        self._contacts[peer] = contact
        self._state[peer] = _NEW
        self._depth[peer] = depth
        bisect.insort(self._order, (contact.node_id ^ self.target, peer))

    def _window(self) -> list[PeerID]:
        """The k closest known contacts that have not failed."""
        return [peer for _, peer in self._order[: self.k]]

    def next_queries(self) -> list[Contact]:
        if self._stopped:
            return []
        queries = []
        limit = self.k if self.wide or self.last_round else self.alpha
        for peer in self._window():
            if self._in_flight >= limit:
                break
            if self._state[peer] == _NEW:
                self._state[peer] = _IN_FLIGHT
                self._in_flight += 1
                queries.append(self._contacts[peer])
        return queries

    def _settle(self, contact: Contact, state: int) -> bool:
        peer = contact.peer_id
        if self._state.get(peer) != _IN_FLIGHT:
            return False  # unknown, or answered twice: ignore
        self._state[peer] = state
        self._in_flight -= 1
        return True

    def on_response(self, contact: Contact, found: list[Contact]) -> None:
        peer = contact.peer_id
        if peer in self._late:  # back into the window, as if it had answered in time
            self._state[peer] = _RESPONDED
            if not self._late.pop(peer):
                bisect.insort(self._order, (contact.node_id ^ self.target, peer))
        elif not self._settle(contact, _RESPONDED):
            return
        self._answered = True
        depth = self._depth[peer] + 1
        for new in found:
            self._add(new, depth)

    def on_failure(self, contact: Contact) -> None:
        peer = contact.peer_id
        if peer in self._late:
            self._state[peer] = _FAILED
            if self._late.pop(peer):
                self._order.remove((contact.node_id ^ self.target, peer))
        elif self._settle(contact, _FAILED):
            self._order.remove((contact.node_id ^ self.target, peer))

    def on_timeout(self, contact: Contact, replace: bool = True) -> None:
        """A query ran past its timeout: it leaves the window, so the next contact is asked, but a
        reply that still comes counts (``on_response``): a slow peer costs a hedge, not its place
        among the closest. ``replace=False``: it stays, and the lookup no longer waits for it."""
        if self._settle(contact, _LATE):
            self._late[contact.peer_id] = not replace
            if replace:
                self._order.remove((contact.node_id ^ self.target, contact.peer_id))

    @property
    def last_round(self) -> bool:
        """Kademlia's last round: the alpha closest known have answered, so the rest of the k
        closest are asked at once rather than alpha at a time (a round trip each)."""
        return all(self._state[p] == _RESPONDED for p in self._window()[: self.alpha])

    @property
    def finished(self) -> bool:
        if self._stopped:
            return True
        if self._in_flight or any(self._state[p] == _NEW for p in self._window()):
            return False
        # with no answer at all, a late query is all there is left to wait for (a join's bootstrap)
        return self._answered or not self._late

    def stop(self) -> None:
        """End early (e.g. once a value is found): no further queries are issued."""
        self._stopped = True

    def result(self) -> list[Contact]:
        """The k closest contacts that answered."""
        responded = (p for _, p in self._order if self._state[p] == _RESPONDED)
        return [self._contacts[p] for _, p in zip(range(self.k), responded)]

    def radius(self) -> int | None:
        """The distance a contact must beat to enter the window (its k-th); None while it has room."""
        return self._order[self.k - 1][0] if len(self._order) >= self.k else None

    def window_ids(self) -> list[int]:
        """The node ids of the window's contacts: what a reply need not name again."""
        return [d ^ self.target for d, _ in self._order[: self.k]]

    def depth(self, contact: Contact) -> int:
        """The hop at which we learned of ``contact`` (1 = it was in our own table)."""
        return self._depth[contact.peer_id]

    @property
    def queried(self) -> int:
        """How many contacts were asked so far (a cost measure for tests and logs)."""
        return sum(1 for s in self._state.values() if s != _NEW)
