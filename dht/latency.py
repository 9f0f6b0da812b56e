"""How long to wait for a peer's reply before a lookup asks someone else (``RttEstimator``), sans-IO.

Per peer, a smoothed round-trip time and its variation as TCP keeps them (RFC 6298), giving a
timeout of ``srtt + 4 * rttvar`` between a floor and a ceiling. A peer never measured gets the
node-wide estimate; with no measurement at all, the ceiling (the RPC timeout). A peer that ran
past its timeout has its own doubled until it answers again (TCP's backoff), so a slow peer is
waited for longer next time rather than asked and abandoned on every lookup.

A lookup that asks its whole window at once (``latest``) also stops waiting for a query far slower
than its siblings in the same lookup (``Stragglers``): the last of ten replies is the tail of one,
so one stalled peer would set the whole lookup's latency.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["RttEstimator", "Stragglers"]

_ALPHA, _BETA, _K = 1 / 8, 1 / 4, 4  # RFC 6298's gains and variance factor


class _Rtt:
    __slots__ = ("srtt", "rttvar", "backoff")

    def __init__(self, sample: float):
        self.srtt, self.rttvar, self.backoff = sample, sample / 2, 1.0

    def observe(self, sample: float) -> None:
        self.rttvar += _BETA * (abs(self.srtt - sample) - self.rttvar)
        self.srtt += _ALPHA * (sample - self.srtt)
        self.backoff = 1.0

    def rto(self) -> float:
        return (self.srtt + _K * self.rttvar) * self.backoff


class RttEstimator:
    """Adaptive reply timeouts per peer (at most ``max_peers`` remembered, least recently measured
    forgotten first), each within ``[floor, ceiling]`` seconds."""

    def __init__(self, floor: float, ceiling: float, max_peers: int = 4096):
        if not 0 < floor <= ceiling:
            raise ValueError(f"need 0 < floor <= ceiling, got {floor} and {ceiling}")
        self.floor, self.ceiling, self.max_peers = floor, ceiling, max_peers
        self._peers: OrderedDict[Hashable, _Rtt] = OrderedDict()
        self._all: _Rtt | None = None  # every peer's samples together: the guess for a new peer

    def observe(self, peer: Hashable, rtt: float) -> None:
        """A reply from ``peer`` came ``rtt`` seconds after its request."""
        rtt = max(0.0, rtt)
        if self._all is None:
            self._all = _Rtt(rtt)
        else:
            self._all.observe(rtt)
        known = self._peers.pop(peer, None)
        if known is None:
            known = _Rtt(rtt)
        else:
            known.observe(rtt)
        self._peers[peer] = known
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)

    def timed_out(self, peer: Hashable) -> None:
        """``peer`` ran past its timeout: double it until its next reply."""
        known = self._peers.get(peer)
        if known is not None:
            known.backoff = min(known.backoff * 2, 64.0)

    def timeout(self, peer: Hashable) -> float:
        """Seconds to wait for ``peer``'s reply before asking another peer too."""
        est = self._peers.get(peer) or self._all
        if est is None:
            return self.ceiling
        return min(self.ceiling, max(self.floor, est.rto()))


class Stragglers:
    """One ``k``-wide lookup's reply times, and how long its queries are worth waiting for:
    ``factor`` times the fastest quarter's reply time, and at least ``slack`` seconds more
    (scheduling noise). A peer that much slower than the others asked under the same load is
    stalled (its process waiting for a CPU, say): with enough copies in hand, leaving it behind
    beats waiting out its adaptive timeout, which one slow period inflates."""

    def __init__(self, k: int, factor: float = 3.0, slack: float = 0.005):
        self.k, self.factor, self.slack = k, factor, slack
        self._times: list[float] = []

    def answered(self, seconds: float) -> None:
        bisect.insort(self._times, seconds)

    def cutoff(self) -> float | None:
        """Seconds after its sending at which a query is a straggler, once half of k answered (the
        copies the lookup may end with); None before."""
        if len(self._times) < self.k // 2:
            return None
        fast = self._times[len(self._times) // 4]
        return max(self.factor * fast, fast + self.slack)
