"""Sans-IO group planning for matchmaking: the order of peers in a round, how a seen set splits
into groups, and how long that set must stay unchanged before a peer stops gathering."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Gathered:
    """What a gather has seen when it decides whether to stop (loop times in seconds)."""

    n: int  # candidates, us included
    min_size: int  # the smallest group worth planning
    expected: int | None  # peers we were told to expect, us included (None: no hint)
    finished: int  # other peers seen done (grouped already, or gave up)
    last_growth: float  # when the candidates last grew
    settle: float  # settle_window() of the arrivals seen
    grace: float  # expected_grace(): the settle window while expected peers are missing
    reserve: float  # time kept before the deadline to join and run the round
    deadline: float
    joined: bool  # a peer joined us: it has settled


def gather_verdict(g: Gathered, now: float) -> tuple[str, float]:
    """``("plan", now)``: plan with the candidates; ``("alone", now)``: nobody to meet; or
    ``("wait", t)``: look again at loop time ``t`` at the latest (or when an entry lands).

    A set that stayed unchanged for the settle window is final; so is one holding everyone
    expected. While expected peers are missing the window is at least the grace, and a join does
    not end it (the joiner's view may be staler than ours). Near the deadline we plan with whoever
    is there; with too few, we give up at the deadline, or at once when everyone expected is done.
    """
    missing = g.expected is not None and g.n < g.expected
    settle = max(g.settle, g.grace) if missing else g.settle
    if g.n >= g.min_size:
        if (now - g.last_growth >= settle or (g.expected is not None and not missing)
                or (g.joined and not missing) or now >= g.deadline - g.reserve):
            return "plan", now
        return "wait", min(g.last_growth + settle, g.deadline - g.reserve)
    if now >= g.deadline:
        return "alone", now
    if g.expected is not None and g.n == 1 and g.finished + 1 >= g.expected:
        return "alone", now  # everyone we were told to expect grouped (or gave up) without us
    return "wait", g.deadline
