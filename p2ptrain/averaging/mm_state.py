"""The state one peer keeps for one matchmaking round, shared by the board, the gather and the
join protocol (``matchmaking.py``, ``board.py``, ``join.py``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from dht import Contact, PeerID

from .group import Group, Member
from .plan import MIN_SETTLE


@dataclass
class Lead:
    """A leader's open group: whom it planned, who joined, when it closes."""

    expected: set[PeerID]
    opened_at: float  # loop time
    close_at: float
    joined: dict[PeerID, Member] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future | None = None  # -> Group, or None when it closed too small
    closed: bool = False


class MatchRound:
    """One round's matchmaking at one peer: its role, its entry, what its reads found."""

    def __init__(self, round_id: str, key: str, min_size: int, timeout: float):
        self.round_id = round_id
        self.key = key
        self.min_size = min_size  # the smallest group this round may form (else: alone)
        self.timeout = timeout
        self.state = "gathering"  # gathering | leading | following | done
        self.changed = asyncio.Event()
        self.join_hint = asyncio.Event()
        self.lead: Lead | None = None
        self.redirect: Member | None = None
        self.group: Group | None = None
        self.entry_value: dict | None = None
        self.entry_expiration = 0.0
        self.registered: dict[PeerID, Member] = {}  # each peer as it registered (claims.verify_group)
        self.arrivals: dict[PeerID, float] = {}  # each entry's registration time (unix), ours included
        self.spread_noted = False  # (once over: its arrivals' spread counted, see Matchmaker._note_spreads)
        self.settle = MIN_SETTLE  # the last settle window used while gathering
        self.holders: list[Contact] = []  # peers that store the round's key (routing table, then lookups)
        self.mates: list[Contact] = []  # peers expected in our group: our entry goes to them too
        self.reads = 0
        self.looked_up = asyncio.Event()  # the full lookup of the key is over: rnd.holders is its answer
        self.started = time.monotonic()
        self.marks: dict[str, float] = {}  # phase -> seconds since ``started``, first time reached

    def mark(self, phase: str) -> None:
        """Note when ``phase`` (registered, first_read, all_seen, planned, ...) was first reached."""
        self.marks.setdefault(phase, time.monotonic() - self.started)

    def set_state(self, state: str) -> None:
        self.state = state
        event, self.changed = self.changed, asyncio.Event()
        event.set()
