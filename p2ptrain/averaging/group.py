"""What matchmaking hands to the all-reduce: an ordered group of members and its shard layout.

Sans-IO: a ``Group`` is plain data every member derives identically from the same bytes (the leader
sends the member list; each member computes the partition itself), so members never disagree on
who owns which shard.

Bandwidth and weight are each member's own claims: ``partition`` counts a bandwidth at most
:data:`MAX_BANDWIDTH_RATIO` times the group's median, so that nobody owns more than about that
many fair shares by claiming 1e15; weights are bounded the same way (``weight_cap``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dht import Multiaddr, PeerID

from ..addresses import Reach, parse_addr, parse_relays

#: the largest share of the vector a member owns, in multiples of the median member's (see above)
MAX_BANDWIDTH_RATIO = 2.0
#: the most samples one member counts for, in multiples of the group's median declared weight
#: (what matters under ``mean``: a robust rule caps at the median): a GPU beside CPUs fits, 1e12 not
MAX_WEIGHT_RATIO = 8.0


@dataclass(frozen=True)
class Member:
    """One peer of a group, dialed at ``addr`` (direct) or through ``relays`` (its circuit
    addresses, behind NAT). Neither: a client-mode peer, which sends but owns no shard."""

    peer_id: PeerID
    addr: tuple[str, int] | None
    bandwidth: float = 1.0  # declared, relative: shards are sized in proportion to it (capped)
    weight: float | None = None  # declared samples for this round (None: not declared)
    relays: tuple[Multiaddr, ...] = ()

    @property
    def reach(self) -> Reach:
        return Reach(self.addr, self.relays)

    @property
    def owns_shard(self) -> bool:
        return bool(self.reach) and self.bandwidth > 0

    def to_wire(self) -> list:
        out = [self.peer_id.to_bytes(), list(self.addr) if self.addr else None, float(self.bandwidth)]
        if self.relays:
            return [*out, None if self.weight is None else float(self.weight), self.reach.relays_wire()]
        return out if self.weight is None else [*out, float(self.weight)]

    @classmethod
    def from_wire(cls, obj: object) -> Member:
        if not (isinstance(obj, list) and 3 <= len(obj) <= 5):
            raise ValueError("malformed group member")
        raw, addr, bandwidth = obj[:3]
        weight = obj[3] if len(obj) >= 4 else None
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not 0 < weight <= 1e12):
            raise ValueError("malformed member weight")
        if not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth < 1e15 or bandwidth != bandwidth:
            raise ValueError("malformed member bandwidth")
        peer = PeerID(raw)
        relays = parse_relays(obj[4], peer) if len(obj) == 5 else ()
        return cls(peer, parse_addr(addr), float(bandwidth), None if weight is None else float(weight), relays)


@dataclass(frozen=True)
class Group:
    """An averaging group for one round: ``members`` in rank order, the same on every member."""

    group_id: bytes
    members: tuple[Member, ...]

    def rank_of(self, peer: PeerID) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer:
                return i
        raise KeyError(f"{peer} is not in group {self.group_id.hex()}")

    @property
    def size(self) -> int:
        return len(self.members)

    def to_wire(self) -> list:
        return [self.group_id, [m.to_wire() for m in self.members]]

    @classmethod
    def from_wire(cls, obj: object, max_size: int = 1024) -> Group:
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], bytes) and isinstance(obj[1], list)):
            raise ValueError("malformed group")
        if not 0 < len(obj[1]) <= max_size or len(obj[0]) > 64:
            raise ValueError("group size out of bounds")
        members = tuple(Member.from_wire(m) for m in obj[1])
        if len({m.peer_id for m in members}) != len(members):
            raise ValueError("duplicate group member")
        return cls(obj[0], members)


def partition(numel: int, members: tuple[Member, ...] | list[Member], align: int = 256) -> list[tuple[int, int]]:
    """Split ``numel`` elements into one [start, end) shard per member, sized by bandwidth.

    Members that own no shard get an empty range. Boundaries are multiples of ``align`` (so that
    blockwise codecs never straddle two owners), except the very end. A bandwidth counts at most
    ``MAX_BANDWIDTH_RATIO`` times the median of the owners'. Deterministic: every member
    computes the same layout from the same group.
    """
    weights = [m.bandwidth if m.owns_shard else 0.0 for m in members]
    owners = [w for w in weights if w > 0]
    if owners:
        cap = MAX_BANDWIDTH_RATIO * statistics.median(owners)
        weights = [min(w, cap) for w in weights]
    total = sum(weights)
    if total <= 0:
        raise ValueError("no member of the group can own a shard (all are client-mode)")
    bounds, start, acc = [], 0, 0.0
    owners_left = sum(1 for w in weights if w > 0)
    for w in weights:
        if w <= 0:
            bounds.append((start, start))
            continue
        owners_left -= 1
        acc += w
        end = numel if owners_left == 0 else min(numel, int(round(numel * acc / total / align)) * align)
        end = max(end, start)
        bounds.append((start, end))
        start = end
    return bounds


def weight_cap(members: tuple[Member, ...] | list[Member], own: float) -> float:
    """The most samples one member of this group counts for: ``MAX_WEIGHT_RATIO``
    times the median of the weights the members declared in matchmaking (signed, and checked by
    every member against the DHT), or of ``own`` where nobody declared one (a group built by hand)."""
    declared = [m.weight for m in members if m.weight is not None]
    return MAX_WEIGHT_RATIO * (statistics.median(declared) if declared else own)


def counted_weight(member: Member, weight: float, cap: float) -> float:
    """What a sender's header ``weight`` counts for at an owner: at most the weight ``member``
    declared in matchmaking (when it declared one) and at most ``cap`` (``weight_cap``)."""
    return min(weight, cap, weight if member.weight is None else member.weight)


def declared_weights(group: Group, own: float) -> tuple[float, ...]:
    """Each member's weight as the group counts it, from what it declared in matchmaking
    (``counted_weight`` of its declared weight; 0.0 where it declared none): the same on every member."""
    cap = weight_cap(group.members, own)
    return tuple(0.0 if m.weight is None else counted_weight(m, m.weight, cap) for m in group.members)
