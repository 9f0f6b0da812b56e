"""A token bucket that caps a provider's upload rate. Sans-IO: the caller passes the clock.

Why it exists: to measure how a fetch from K providers scales, each provider must be limited to
the same rate R (as a real uplink would be) without ``tc`` or root; and a peer that serves
checkpoints while it trains may want to keep some of its bandwidth for averaging.

The bucket runs into debt rather than refusing: ``take(n, now)`` always grants ``n`` bytes and
returns how long to wait before sending them, so several streams sharing one bucket are served in
the order they asked and together never exceed ``rate`` over any window longer than
``burst / rate``.
"""

from __future__ import annotations

import math


class TokenBucket:
    """``rate`` bytes per second on average, bursts of at most ``burst`` bytes."""

    def __init__(self, rate: float, burst: float | None = None):
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a positive number of bytes per second, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(self.rate * 0.05, 256 * 1024.0)
        if self.burst <= 0:
            raise ValueError("burst must be positive")
        self._tokens = self.burst
        self._last: float | None = None

    def take(self, n: int, now: float) -> float:
        """Reserve ``n`` bytes at time ``now`` (seconds, any monotonic clock); returns the seconds
        to wait before sending them (0 when the bucket holds enough)."""
        if n < 0:
            raise ValueError("cannot take a negative number of bytes")
        if self._last is not None and now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        if self._last is None or now > self._last:
            self._last = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
