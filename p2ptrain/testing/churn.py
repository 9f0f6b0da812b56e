"""Churn for soak runs, sans-IO: a seeded schedule of SIGKILLs and starts, and a progress watch.

Why a separate core: the soak benchmark (``benchmarks/soak.py``) and its short version in the
tests drive real processes, but *which* process dies when, who a newcomer joins through, and when
a silent peer counts as hung are decisions that must be reproducible (a seed) and testable without
spawning anything. The driver feeds observations in (who is alive, their addresses, their progress
lines, the clock) and carries out the actions that come back; nothing here touches a process, a
socket or the real clock.

Two kinds of process take part: *trainers* (``p2ptrain peer``) and the *bootstrap*, a DHT-only
``p2ptrain dht`` process that is the swarm's first entry point. Both can be killed: after the
bootstrap dies, newcomers (and its replacement) join through any live peer's address.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kill:
    """SIGKILL this process (a crash, as far as its peers can tell)."""

    name: str
    bootstrap: bool


@dataclass(frozen=True)
class Start:
    """Start a new process named ``name`` that joins through ``join`` (multiaddrs of live peers).
    ``bootstrap``: a DHT-only process replacing a killed bootstrap, else a trainer."""

    name: str
    bootstrap: bool
    join: tuple[str, ...]


Action = Kill | Start


@dataclass
class ChurnSchedule:
    """Which process to kill when, and what to start, so that ``peers`` trainers stay (roughly) alive.

    Call :meth:`step` often (every few hundred ms) with the live processes; it returns the kills
    that are due (one every ``every`` seconds on average, jittered by +-50% so kills do not beat
    against the peers' own periodic work), then the starts that bring the swarm back to strength.
    Every ``bootstrap_every``-th kill takes the bootstrap (0: never; when it has not announced
    itself yet, the next kill does), the others a random trainer that has announced itself, never
    leaving fewer than ``min_live`` of them: the swarm's state must survive in someone.
    Deterministic kill counts make "the bootstrap died at least once" something a short test can
    rely on, where a probability would only make it likely. Newcomers join through up to ``join_through``
    random live addresses. Deterministic for a given seed and sequence of calls.
    """

    peers: int
    every: float
    seed: int = 0
    bootstrap_every: int = 5
    min_live: int = 2
    join_through: int = 3
    kills: int = 0
    starts: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _next_kill: float | None = field(default=None, init=False, repr=False)
    _serial: int = field(default=0, init=False, repr=False)
    _boot_due: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.peers < 1:
            raise ValueError(f"peers must be at least 1, got {self.peers}")
        if not self.every > 0:
            raise ValueError(f"every must be a positive number of seconds, got {self.every}")
        if self.bootstrap_every < 0:
            raise ValueError(f"bootstrap_every must be 0 (never) or a positive count, got {self.bootstrap_every}")
        self._rng = random.Random(self.seed)

    def name(self, bootstrap: bool) -> str:
        """A fresh process name (``peerN`` / ``bootN``): names are never reused, so events of a
        killed process can never be mistaken for its replacement's."""
        self._serial += 1
        return f"{'boot' if bootstrap else 'peer'}{self._serial}"

    def step(self, now: float, trainers: Mapping[str, str | None],
             bootstraps: Mapping[str, str | None]) -> list[Action]:
        """The actions due at ``now``. ``trainers``/``bootstraps``: every live process of each kind,
        with its announced multiaddr (None while it is still starting)."""
        actions: list[Action] = []
        trainers, bootstraps = dict(trainers), dict(bootstraps)
        if self._next_kill is None:
            self._next_kill = now + self._gap()
        if now >= self._next_kill:
            self._boot_due = self._boot_due or (self.bootstrap_every > 0
                                                and (self.kills + 1) % self.bootstrap_every == 0)
            victim = self._victim(trainers, bootstraps)
            if victim is not None:
                actions.append(victim)
                self.kills += 1
                (bootstraps if victim.bootstrap else trainers).pop(victim.name)
            self._next_kill = now + self._gap()
        addrs = sorted(a for a in (*trainers.values(), *bootstraps.values()) if a)
        if not addrs:
            return actions  # nobody to join through yet: wait for an announcement
        if not bootstraps:
            actions.append(Start(self.name(True), True, self._join(addrs)))
            self.starts += 1
        for _ in range(self.peers - len(trainers)):
            actions.append(Start(self.name(False), False, self._join(addrs)))
            self.starts += 1
        return actions

    def _gap(self) -> float:
        return self.every * self._rng.uniform(0.5, 1.5)

    def _victim(self, trainers: dict[str, str | None], bootstraps: dict[str, str | None]) -> Kill | None:
        boot = sorted(n for n, a in bootstraps.items() if a)
        if boot and self._boot_due:
            self._boot_due = False
            return Kill(self._rng.choice(boot), True)
        announced = sorted(n for n, a in trainers.items() if a)
        if len(announced) <= self.min_live:
            return None
        return Kill(self._rng.choice(announced), False)

    def _join(self, addrs: list[str]) -> tuple[str, ...]:
        return tuple(self._rng.sample(addrs, min(self.join_through, len(addrs))))


@dataclass
class _Peer:
    spawned: float
    last: float  # last sign of life: the spawn, the started event or a progress line
    started: bool = False
    hung: bool = False  # reported for the current silence


@dataclass
class ProgressWatch:
    """Judges a swarm from its peers' event lines: the epoch frontier over time, and hung peers.

    A peer *hangs* when it is alive, announced, and has printed no progress line for ``hang_after``
    seconds while some other peer did within that window (a swarm-wide pause, e.g. everyone waiting
    out a round timeout, is not one peer hanging); a peer that has not announced itself
    ``start_after`` seconds after it was spawned hangs too. Each silence is reported once.
    """

    hang_after: float = 30.0
    start_after: float = 120.0
    frontier: int = 0  # the highest epoch any peer has reported
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, frontier) at each rise
    hangs: list[tuple[float, str, str]] = field(default_factory=list)  # (time, name, why)
    _peers: dict[str, _Peer] = field(default_factory=dict)

    def spawned(self, name: str, now: float) -> None:
        self._peers[name] = _Peer(spawned=now, last=now)

    def gone(self, name: str) -> None:
        """The process exited or was killed: it can no longer hang."""
        self._peers.pop(name, None)

    def started(self, name: str, now: float, epoch: int) -> None:
        p = self._peers.get(name)
        if p is not None:
            p.started, p.last, p.hung = True, now, False
        self._epoch(now, epoch)

    def progress(self, name: str, now: float, epoch: int) -> None:
        p = self._peers.get(name)
        if p is not None:
            p.started, p.last, p.hung = True, now, False
        self._epoch(now, epoch)

    def _epoch(self, now: float, epoch: int) -> None:
        if epoch > self.frontier:
            self.frontier = epoch
            self.timeline.append((now, epoch))

    def check(self, now: float) -> list[tuple[float, str, str]]:
        """Newly hung peers at ``now`` (also appended to :attr:`hangs`)."""
        new = []
        for name, p in self._peers.items():
            if p.hung:
                continue
            if not p.started:
                if now - p.spawned > self.start_after:
                    new.append((now, name, f"no started event {now - p.spawned:.0f} s after its spawn"))
                    p.hung = True
                continue
            silent = now - p.last
            if silent > self.hang_after and self._moved_without(name, now):
                new.append((now, name, f"no progress line for {silent:.0f} s while others progressed"))
                p.hung = True
        self.hangs.extend(new)
        return new

    def _moved_without(self, name: str, now: float) -> bool:
        return any(n != name and q.started and now - q.last <= self.hang_after for n, q in self._peers.items())

    def epoch_at(self, t: float) -> int:
        """The frontier at time ``t`` (0 before the first report)."""
        epoch = 0
        for when, e in self.timeline:
            if when > t:
                break
            epoch = e
        return epoch

    def epochs_per_minute(self, t0: float, t1: float) -> float:
        """How fast the frontier advanced between ``t0`` and ``t1``."""
        if t1 <= t0:
            raise ValueError(f"empty interval [{t0}, {t1}]")
        return (self.epoch_at(t1) - self.epoch_at(t0)) * 60.0 / (t1 - t0)
