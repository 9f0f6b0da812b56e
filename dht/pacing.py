"""How fast one peer may make us work (``RequestPacer``): a token bucket per connection, sans-IO.

Requests and stream opens spend a token each, stream data frames under ``stream.COALESCE_BELOW``
a quarter (``SMALL_FRAME_COST``): a peer sending 1-byte frames made the victim decrypt and
dispatch some 50k a second, its training ran at 0.3x, memory bounded or not. A quarter, not a
whole token: such a frame costs less than a request (no decode, no handler), and a relay's
connection to a peer behind it carries the small frames of every circuit to that peer. The
connection leaves the socket unread while the bucket is empty (see ``Limits.request_rate``).
"""

from __future__ import annotations

__all__ = ["SMALL_FRAME_COST", "RequestPacer"]

#: tokens a small stream data frame spends (a request or a stream open: 1)
SMALL_FRAME_COST = 0.25


class RequestPacer:
    """A bucket of tokens refilled at a rate, holding at most a burst (both given per call, so
    that a change to the host's ``Limits`` applies at once); a rate <= 0 never paces."""

    __slots__ = ("_tokens", "_at")

    def __init__(self, burst: int, now: float):
        self._tokens = float(burst)
        self._at = now

    def spend(self, now: float, rate: float, burst: int, cost: float = 1.0) -> tuple[bool, float]:
        """Spend ``cost`` tokens at ``now``: (whether they were there, seconds to leave the peer
        unread before its next frame: 0 while a whole token is left)."""
        if rate <= 0:
            return True, 0.0
        self._refill(now, rate, burst)
        allowed = self._tokens >= cost
        # Spent even when refused, into debt: the frames of one read (up to ~2000 tiny ones) are
        # all handled before the socket can be paused, and each cost us work; the pause waits
        # their debt out (without it a flood of 1-byte frames was read at ~50k frames/s, not 1000).
        self._tokens -= cost
        return allowed, (1.0 - self._tokens) / rate if self._tokens < 1.0 else 0.0

    def due(self, now: float, rate: float, burst: int) -> float:
        """Seconds until a token is there again (0: now)."""
        if rate <= 0:
            return 0.0
        self._refill(now, rate, burst)
        return (1.0 - self._tokens) / rate if self._tokens < 1.0 else 0.0

    def _refill(self, now: float, rate: float, burst: int) -> None:
        self._tokens = min(float(burst), self._tokens + (now - self._at) * rate)
        self._at = now
