"""Sans-IO group planning for matchmaking: the order of peers in a round, how a seen set splits
into groups, and how long that set must stay unchanged before a peer stops gathering."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

from dht import PeerID

from .group import Member

MAX_ROUND_ID = 200  # characters of a round id (form_group's argument, a join's "round")
MIN_SETTLE = 0.1  # s: the shortest settle window
EXPECTED_GRACE = 0.5  # s: the shortest wait for peers we were told to expect (a tenth of the timeout if less)


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
    servers = sorted((m for m in unique.values() if m.reach), key=lambda m: score(m.peer_id, round_key))
    clients = sorted((m for m in unique.values() if not m.reach), key=lambda m: score(m.peer_id, round_key))
    if not servers:
        return []
    ordered = (servers + clients)[: len(servers) * target]
    n_groups = min(math.ceil(len(ordered) / target), len(servers))
    groups: list[list[Member]] = [[] for _ in range(n_groups)]
    for i, member in enumerate(ordered):
        groups[i % n_groups].append(member)
    return groups


def settle_window(latency: float, arrivals: Iterable[float], timeout: float) -> float:
    """How long the set of registered peers must stay unchanged before we stop gathering.

    ``max(100 ms, 3 x DHT read latency, 2 x mean gap between the last 8 arrivals)``: quick when
    everyone arrives at once on a fast network, patient when peers trickle in; capped at a fifth
    of the timeout so that a hostile arrival time cannot make us wait long.
    """
    window = max(MIN_SETTLE, 3.0 * latency)
    recent = sorted(arrivals)[-8:]
    if len(recent) >= 2:
        window = max(window, 2.0 * (recent[-1] - recent[0]) / (len(recent) - 1))
    return min(window, max(MIN_SETTLE, 0.2 * timeout))


def expected_grace(spreads: Iterable[float], latency: float, timeout: float) -> float:
    """How long the set of peers must stay unchanged while some we were told to expect are missing.

    ``1.5 x`` the widest first-to-last arrival spread of recent rounds plus two DHT reads: a peer
    as late as the latest of them is still met. At least ``EXPECTED_GRACE`` (a tenth of the
    timeout if less), at most a third of the timeout: an expected peer may be gone, and a hostile
    arrival time must not hold a round for long.
    """
    floor = min(EXPECTED_GRACE, 0.1 * timeout)
    widest = max(spreads, default=0.0)
    return min(max(floor, 1.5 * widest + 2.0 * latency), max(floor, timeout / 3))
