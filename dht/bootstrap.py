"""The bootstrap dial plan: which address to dial next, and when (sans-IO).

Why retry at all: under churn, a newcomer is often handed addresses of peers that die while it
starts. A dead address fails at once ("connection refused"), so trying each one once wasted the
whole ``bootstrap_timeout`` budget in milliseconds; and a peer that is itself still starting (a
swarm launched together) answers a moment later. So every address that refuses or times out is
retried with a jittered exponential backoff (0.2 s doubling to 2 s) until the deadline, and the
node joins through the first one that answers.

What is *not* retried (``permanent=True``): a swarm-key refusal, or a peer id that does not match
the address. Those are settings to fix, not a race to wait out, and must fail fast and clearly.

Cached peers (see :mod:`dht.peercache`) are a fallback: they are dialed only once every given
address has failed at least once, or ``cache_after`` seconds into the attempt (a blackholed
address can hang a dial for the whole budget). The addresses the user gave come first, so a node
does not silently join the swarm of its last run when its new bootstrap peer is merely slow.

The plan does no I/O and reads no clock: the caller passes ``now`` (monotonic seconds) and an
optional ``random.Random``, which makes the schedule testable to the millisecond.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from .multiaddr import Multiaddr

#: first retry delay, and its cap: a peer starting up answers within a few hundred ms, and a cap of
#: 2 s keeps a retry close to the moment a peer comes back without dialing dead addresses in a loop
RETRY_INITIAL = 0.2
RETRY_MAX = 2.0
#: seconds after which cached peers are dialed even if a given address has not failed yet
CACHE_AFTER = 2.0


@dataclass
class Target:
    """One address and its retry state."""

    addr: Multiaddr
    cached: bool
    next_at: float
    delay: float
    attempts: int = 0
    in_flight: bool = False
    gave_up: bool = False  # failed permanently: never dialed again
    last_error: str | None = None
    refused: bool = False  # the last failure was a swarm-key refusal


class DialPlan:
    """The retry schedule of one bootstrap: ``due`` says what to dial now, ``failed`` records an
    outcome, ``wait`` says how long the caller may sleep. Success needs no call: the caller joins.
    """

    def __init__(
        self,
        given: Iterable[Multiaddr],
        cached: Iterable[Multiaddr] = (),
        *,
        now: float,
        timeout: float,
        initial: float = RETRY_INITIAL,
        maximum: float = RETRY_MAX,
        cache_after: float = CACHE_AFTER,
        rng: random.Random | None = None,
    ):
        self.started = now
        self.deadline = now + timeout
        self.initial, self.maximum = initial, maximum
        self.cache_after = cache_after
        self._rng = rng or random.Random()
        self.targets: dict[str, Target] = {}
        for addr in given:
            self.targets.setdefault(str(addr), Target(addr, False, now, initial))
        for addr in cached:  # an address the user also gave stays a given one
            self.targets.setdefault(str(addr), Target(addr, True, math.inf, initial))
        self._fallback = False

    # ------------------------------------------------------------------ views

    @property
    def given(self) -> list[Target]:
        return [t for t in self.targets.values() if not t.cached]

    @property
    def cached(self) -> list[Target]:
        return [t for t in self.targets.values() if t.cached]

    @property
    def attempts(self) -> int:
        return sum(t.attempts for t in self.targets.values())

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def remaining(self, now: float) -> float:
        return max(0.0, self.deadline - now)

    @property
    def given_up(self) -> bool:
        """Every given address failed permanently (refused us, or is another peer): waiting cannot
        help and the cache must not paper over a setting the user has to fix."""
        given = self.given
        return bool(given) and all(t.gave_up for t in given)

    @property
    def all_refused(self) -> bool:
        """Every given address refused the handshake over the swarm key."""
        given = self.given
        return bool(given) and all(t.gave_up and t.refused for t in given)

    @property
    def idle(self) -> bool:
        """Nothing is in flight and nothing will ever be dialed again."""
        return all(t.gave_up for t in self.targets.values())

    # ------------------------------------------------------------------ schedule

    def _check_fallback(self, now: float) -> None:
        if self._fallback:
            return
        given = self.given
        if now - self.started >= self.cache_after or all(t.attempts and not t.in_flight for t in given):
            self._fallback = True
            for t in self.cached:
                if not t.gave_up and t.attempts == 0:
                    t.next_at = now

    def due(self, now: float) -> list[Multiaddr]:
        """The addresses to dial now; they count as in flight until ``failed`` (or success)."""
        if self.expired(now) or self.given_up:
            return []
        self._check_fallback(now)
        out = []
        for t in self.targets.values():
            if not t.in_flight and not t.gave_up and t.next_at <= now:
                t.in_flight = True
                t.attempts += 1
                out.append(t.addr)
        return out

    def failed(self, addr: Multiaddr, error: str, now: float, *, permanent: bool = False,
               refused: bool = False) -> None:
        """Record a failed attempt: schedule the next one after a jittered backoff, or never."""
        t = self.targets[str(addr)]
        t.in_flight = False
        t.last_error = error
        t.refused = refused
        if permanent or refused:
            t.gave_up = True
            return
        # "Equal jitter": half the delay fixed, half random, so newcomers handed the same dead
        # address do not all redial it in lockstep, yet none waits much less than the backoff.
        t.next_at = now + t.delay * (0.5 + 0.5 * self._rng.random())
        t.delay = min(t.delay * 2, self.maximum)
        self._check_fallback(now)

    def wait(self, now: float) -> float:
        """Seconds until the next attempt is due or the deadline passes, whichever is first."""
        upcoming = [t.next_at for t in self.targets.values() if not t.in_flight and not t.gave_up]
        if not self._fallback and self.cached:
            upcoming.append(self.started + self.cache_after)
        return max(0.0, min([self.deadline, *upcoming]) - now)

    # ------------------------------------------------------------------ reporting

    def summary(self, limit: int = 3) -> str:
        """The given addresses and why each last failed, for a one-line error message."""
        given = self.given
        parts = [f"{t.addr}: {t.last_error or 'no answer'}" for t in given[:limit]]
        if len(given) > limit:
            parts.append(f"and {len(given) - limit} more")
        return "; ".join(parts) or "no answer"
