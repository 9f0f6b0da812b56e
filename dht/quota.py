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
from collections.abc import Callable, Iterable

from .errors import InvalidRecord
from .identity import PeerID

Name = tuple[bytes, bytes | None]

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


class _Account:
    """What one holder (a group, or a peer within a group) has stored: counted, and for a peer,
    its records by expiration (entries of records since dropped or replaced are skipped lazily)."""

    __slots__ = ("records", "bytes", "expiring", "members", "largest")

    def __init__(self) -> None:
        self.records = 0
        self.bytes = 0
        self.expiring: list[tuple[float, int, Name]] = []  # (expiration, seq, name), soonest first
        self.members: dict[PeerID | None, _Account] = {}  # a group's peers
        self.largest = _Largest()  # a group's peers, by bytes


class _Largest:
    """The account holding the most bytes among a changing set: a lazy max-heap (an entry per
    growth; stale entries are fixed or dropped when they surface)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, _Account]] = []
        self._seq = itertools.count()

    def grew(self, account: _Account, live: Iterable[_Account], count: int) -> None:
        """``account`` (one of the ``count`` ``live`` ones) grew."""
        if len(self._heap) > 2 * count + 64:  # mostly stale: rebuild
            self._heap = [(-a.bytes, next(self._seq), a) for a in live]
            heapq.heapify(self._heap)
        else:
            heapq.heappush(self._heap, (-account.bytes, next(self._seq), account))

    def top(self) -> _Account | None:
        heap = self._heap
        while heap:
            negative, _, account = heap[0]
            if -negative == account.bytes:
                return account
            heapq.heappop(heap)
            if account.bytes > 0:
                heapq.heappush(heap, (-account.bytes, next(self._seq), account))
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
        self._entries: dict[Name, tuple[Holder, _Account, int, int]] = {}  # name -> (holder, account, cost, seq)
        self._peers: dict[PeerID, list[int]] = {}  # peer -> [records, bytes], for the hard quotas
        self._groups: dict[str | None, _Account] = {}
        self._largest = _Largest()  # groups, by bytes
        self._seq = itertools.count()

    def holder(self, name: Name) -> Holder | None:
        entry = self._entries.get(name)
        return entry[0] if entry is not None else None

    def peer_records(self, peer: PeerID) -> int:
        return self._peers.get(peer, (0, 0))[0]

    def add(self, name: Name, holder: Holder, cost: int, expiration: float) -> None:
        group_name, peer = holder
        group = self._groups.get(group_name)
        if group is None:
            group = self._groups[group_name] = _Account()
        account = group.members.get(peer)
        if account is None:
            account = group.members[peer] = _Account()
        seq = next(self._seq)
        self._entries[name] = (holder, account, cost, seq)
        self.records += 1
        self.bytes += cost
        if peer is not None:
            use = self._peers.setdefault(peer, [0, 0])
            use[0] += 1
            use[1] += cost
        for a in (group, account):
            a.records += 1
            a.bytes += cost
        self._largest.grew(group, self._groups.values(), len(self._groups))
        group.largest.grew(account, group.members.values(), len(group.members))
        heap = account.expiring
        if len(heap) > 2 * account.records + 16:  # mostly replaced records: rebuild
            heap[:] = [e for e in heap if self._live(e)]
            heapq.heapify(heap)
        heapq.heappush(heap, (expiration, seq, name))

    def remove(self, name: Name) -> None:
        (group_name, peer), account, cost, _ = self._entries.pop(name)
        group = self._groups[group_name]
        self.records -= 1
        self.bytes -= cost
        if peer is not None:
            use = self._peers[peer]
            use[0] -= 1
            use[1] -= cost
            if not use[0]:
                del self._peers[peer]
        for a in (group, account):
            a.records -= 1
            a.bytes -= cost
        if not account.records:
            del group.members[peer]
            if not group.records:
                del self._groups[group_name]

    def make_room(self, holder: Holder, cost: int, evict: Callable[[Name], None]) -> None:
        """Raise InvalidRecord unless a record of ``cost`` bytes from ``holder`` fits, evicting
        (through ``evict``, which must call ``remove``) what fairness allows."""
        peer = holder[1]
        if peer is not None:
            records, used = self._peers.get(peer, (0, 0))
            if records + 1 > self.max_records_per_peer:
                raise InvalidRecord(f"too many records from peer {peer}")
            if used + cost > self.max_bytes_per_peer:
                raise InvalidRecord(f"too many bytes from peer {peer} (quota {self.max_bytes_per_peer})")
        while self.records + 1 > self.max_records or self.bytes + cost > self.max_bytes:
            victim = self._victim(holder, cost)
            if victim is None:
                raise InvalidRecord("storage full")
            evict(victim)

    def _victim(self, holder: Holder, cost: int) -> Name | None:
        """The soonest-expiring record of the largest account that may lose one to ``holder``."""
        mine = self._groups.get(holder[0])
        group = self._largest.top()
        if group is None or group is mine or group.bytes <= (mine.bytes if mine else 0) + cost:
            if mine is None:  # our group is (about) the largest: make room inside it
                return None
            group, me = mine, mine.members.get(holder[1])
            top = group.largest.top()
            if top is None or top is me or top.bytes <= (me.bytes if me else 0) + cost:
                return None
        else:
            top = group.largest.top()
            assert top is not None
        heap = top.expiring
        while not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][2]

    def _live(self, entry: tuple[float, int, Name]) -> bool:
        current = self._entries.get(entry[2])
        return current is not None and current[3] == entry[1]
