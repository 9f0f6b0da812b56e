"""Who pays for what a node stores: address groups, per-peer quotas and fair eviction, with no I/O.

Identities are free, addresses are not. A record a peer sent counts against its PeerID (a hard
quota in records and bytes) and against its *address group*: the IPv4 /24 or IPv6 /48 it came
from, or the relay it came through, so that 50 identities from one address are one group.

The store may fill with anyone's records while it has room. Once it is full (in records or in
bytes), a writer evicts the soonest-expiring record of the group holding the most bytes, provided
that group then still holds more than the writer's; inside the writer's own group the same rule
runs between PeerIDs; otherwise the write is refused ("storage full"). A flood from one group thus
only ever evicts its own records once it is the largest, and every other group keeps what it
holds up to an equal share of the store: honest STOREs from elsewhere still succeed during it.

Why no hard per-address cap: peers behind one NAT, a cluster on one /24 and a local swarm on
127.0.0.1 are one group each, and a fixed cap small enough to matter would refuse them even when
the store is empty. Loopback addresses are grouped per address, not per /24: on one machine
``127.0.0.2`` stands for another host (``benchmarks/flood.py`` attacks from it), and all of a local
swarm's peers on 127.0.0.1 share one group, inside which the per-PeerID rule keeps them fair.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import Generic, TypeVar

from .errors import InvalidRecord
from .identity import PeerID

Name = tuple[bytes, bytes | None]
K = TypeVar("K", bound=Hashable)

#: what a stored record costs beyond its bytes: the Record object, its dict, quota and expiry
#: entries (tracemalloc, 100,000 records of 44 bytes from 50 peers in a store: 694 bytes each)
RECORD_OVERHEAD = 640


def address_group(host: str | None, relay: PeerID | None = None) -> str:
    """The group a peer at ``host`` (an IP address, as the socket reports it) counts in: its IPv4
    /24, IPv6 /48, loopback address itself, or the relay it came through (``host`` None)."""
    if host is None:
        return f"relay {relay}" if relay is not None else "unknown"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # not an IP address (a name): the name is the group
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return str(ip)
    prefix = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class _Largest(Generic[K]):
    """The key with the largest value in a mapping whose values change one write at a time: a
    lazy max-heap (an entry per increase; stale entries are fixed or dropped when they surface)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, K]] = []
        self._seq = itertools.count()

    def grew(self, key: K, values: Mapping[K, int]) -> None:
        """``values[key]`` increased."""
        if len(self._heap) > 2 * len(values) + 64:  # mostly stale: rebuild
            self._heap = [(-v, next(self._seq), k) for k, v in values.items()]
            heapq.heapify(self._heap)
        else:
            heapq.heappush(self._heap, (-values[key], next(self._seq), key))

    def top(self, values: Mapping[K, int]) -> K | None:
        """The key of the largest value (None when ``values`` is empty)."""
        heap = self._heap
        while heap:
            negative, _, key = heap[0]
            current = values.get(key, 0)
            if -negative == current:
                return key
            heapq.heappop(heap)
            if current > 0:
                heapq.heappush(heap, (-current, next(self._seq), key))
        return None


Holder = tuple[str | None, PeerID | None]  # (address group, peer); (None, None) is our own writes


class Ledger:
    """What each peer and address group holds in a store, and what to evict to make room.

    The store calls ``add``/``remove`` as records come and go, and ``make_room`` before a write:
    it raises InvalidRecord (the per-peer quota, or "storage full") or evicts through the store's
    callback until the write fits.
    """

    def __init__(self, max_records: int, max_bytes: int, max_records_per_peer: int, max_bytes_per_peer: int):
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.max_records_per_peer = max_records_per_peer
        self.max_bytes_per_peer = max_bytes_per_peer
        self.records = 0
        self.bytes = 0
        self._entries: dict[Name, tuple[Holder, int, int]] = {}  # name -> (holder, cost, seq)
        self._peer_records: Counter[PeerID] = Counter()
        self._peer_bytes: Counter[PeerID] = Counter()
        self._group_bytes: Counter[str | None] = Counter()
        self._holder_bytes: dict[str | None, Counter[Holder]] = {}  # per group, per holder in it
        self._holder_records: Counter[Holder] = Counter()
        self._largest_group: _Largest[str | None] = _Largest()
        self._largest_holder: dict[str | None, _Largest[Holder]] = {}
        #: per holder, (expiration, seq, name) of its records, soonest first (stale entries skipped)
        self._expiring: dict[Holder, list[tuple[float, int, Name]]] = {}
        self._seq = itertools.count()

    def holder(self, name: Name) -> Holder | None:
        entry = self._entries.get(name)
        return entry[0] if entry is not None else None

    def peer_records(self, peer: PeerID) -> int:
        return self._peer_records[peer]

    def add(self, name: Name, holder: Holder, cost: int, expiration: float) -> None:
        group, peer = holder
        seq = next(self._seq)
        self._entries[name] = (holder, cost, seq)
        self.records += 1
        self.bytes += cost
        if peer is not None:
            self._peer_records[peer] += 1
            self._peer_bytes[peer] += cost
        self._group_bytes[group] += cost
        in_group = self._holder_bytes.setdefault(group, Counter())
        in_group[holder] += cost
        self._holder_records[holder] += 1
        self._largest_group.grew(group, self._group_bytes)
        self._largest_holder.setdefault(group, _Largest()).grew(holder, in_group)
        heap = self._expiring.setdefault(holder, [])
        if len(heap) > 2 * self._holder_records[holder] + 16:  # mostly replaced records: rebuild
            heap[:] = [e for e in heap if self._live(e)]
            heapq.heapify(heap)
        heapq.heappush(heap, (expiration, seq, name))

    def remove(self, name: Name) -> None:
        holder, cost, _ = self._entries.pop(name)
        group, peer = holder
        self.records -= 1
        self.bytes -= cost
        if peer is not None:
            _decrease(self._peer_records, peer, 1)
            _decrease(self._peer_bytes, peer, cost)
        _decrease(self._group_bytes, group, cost)
        _decrease(self._holder_records, holder, 1)
        if not _decrease(self._holder_bytes[group], holder, cost):
            del self._expiring[holder]
            if group not in self._group_bytes:
                del self._largest_holder[group], self._holder_bytes[group]

    def make_room(self, holder: Holder, cost: int, evict: Callable[[Name], None]) -> None:
        """Raise InvalidRecord unless a record of ``cost`` bytes from ``holder`` fits, evicting
        (through ``evict``, which must call ``remove``) what fairness allows."""
        peer = holder[1]
        if peer is not None:
            if self._peer_records[peer] + 1 > self.max_records_per_peer:
                raise InvalidRecord(f"too many records from peer {peer}")
            if self._peer_bytes[peer] + cost > self.max_bytes_per_peer:
                raise InvalidRecord(f"too many bytes from peer {peer} (quota {self.max_bytes_per_peer})")
        while self.records + 1 > self.max_records or self.bytes + cost > self.max_bytes:
            victim = self._victim(holder, cost)
            if victim is None:
                raise InvalidRecord("storage full")
            evict(victim)

    def _victim(self, holder: Holder, cost: int) -> Name | None:
        """The soonest-expiring record of the largest holder that may lose one to ``holder``."""
        group = self._largest_group.top(self._group_bytes)
        mine = self._group_bytes.get(holder[0], 0) + cost
        if group is None or group == holder[0] or self._group_bytes[group] <= mine:
            group = holder[0]  # our group is (about) the largest: make room inside it
            in_group = self._holder_bytes.get(group)
            if in_group is None:
                return None
            top = self._largest_holder[group].top(in_group)
            if top is None or top == holder or in_group[top] <= in_group.get(holder, 0) + cost:
                return None
        else:
            top = self._largest_holder[group].top(self._holder_bytes[group])
            assert top is not None
        return self._soonest(top)

    def _soonest(self, holder: Holder) -> Name:
        heap = self._expiring[holder]
        while not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][2]

    def _live(self, entry: tuple[float, int, Name]) -> bool:
        current = self._entries.get(entry[2])
        return current is not None and current[2] == entry[1]


def _decrease(counter: Counter, key: object, amount: int) -> int:
    """Subtract ``amount`` from ``counter[key]``, dropping the key at zero; returns what is left."""
    left = counter[key] - amount
    if left > 0:
        counter[key] = left
    else:
        del counter[key]
    return max(left, 0)
