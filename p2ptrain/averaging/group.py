"""What matchmaking hands to the all-reduce: an ordered group of members and its shard layout.

Sans-IO: a ``Group`` is plain data every member derives identically from the same bytes (the leader
sends the member list; each member computes the partition itself), so members never disagree on
who owns which shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from dht import PeerID


@dataclass(frozen=True)
class Member:
    """One peer of a group. ``addr`` None: a client-mode peer, which sends but owns no shard."""

    peer_id: PeerID
    addr: tuple[str, int] | None
    bandwidth: float = 1.0  # declared, relative: shards are sized in proportion to it

    @property
    def owns_shard(self) -> bool:
        return self.addr is not None and self.bandwidth > 0

    def to_wire(self) -> list:
        return [self.peer_id.to_bytes(), list(self.addr) if self.addr else None, float(self.bandwidth)]

    @classmethod
    def from_wire(cls, obj: object) -> Member:
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("malformed group member")
        raw, addr, bandwidth = obj
        if addr is not None and not (
            isinstance(addr, list) and len(addr) == 2 and isinstance(addr[0], str) and isinstance(addr[1], int)
            and 0 < addr[1] < 65536 and len(addr[0]) <= 255
        ):
            raise ValueError("malformed member address")
        if not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth < 1e15 or bandwidth != bandwidth:
            raise ValueError("malformed member bandwidth")
        return cls(PeerID(raw), tuple(addr) if addr else None, float(bandwidth))


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
    blockwise codecs never straddle two owners), except the very end. Deterministic: every member
    computes the same layout from the same group.
    """
    weights = [m.bandwidth if m.owns_shard else 0.0 for m in members]
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
