"""The leaderboard: per peer, what the receipts a reader found confirm it contributed (sans-IO).

A member's line of a round counts when a strict majority of its group's members signed receipts
holding that identical line (see :mod:`.receipt` for what that protects); a signer that signed two
different receipts of one group counts for neither. Each peer is credited once per round (``run``,
``round_id``), with its largest counted line, so a group made up to name it can neither lower its
credit nor add an exclusion. Compute time and bytes sent are the peer's own claims, from receipts it
signed itself (one per round).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dht import PeerID

from .receipt import Line, Receipt, Signed

__all__ = ["Confirmed", "Row", "confirm", "leaderboard"]


@dataclass(frozen=True)
class Confirmed:
    """One member's counted line of one round: the line, when (the median of its confirmers'
    times), and the exclusion class most of them gave (None: not excluded)."""

    run: str
    round_id: str
    line: Line
    time: float
    why: str | None


@dataclass
class Row:
    """One peer's figures on the leaderboard."""

    peer: PeerID
    name: str | None = None
    rounds: int = 0  # rounds whose receipts a majority of its group signed, naming it
    samples: int = 0  # samples credited over those rounds
    exclusions: int = 0  # of those rounds, the ones it was excluded from
    reasons: Counter = field(default_factory=Counter)  # exclusion class -> rounds
    first_seen: float | None = None
    last_seen: float | None = None
    compute_s: float = 0.0  # claimed, from its own receipts
    bytes_sent: int = 0  # claimed, from its own receipts
    unconfirmed: int = 0  # rounds it appears in whose receipts no majority agreed on its line

    def to_dict(self) -> dict:
        return {"peer_id": str(self.peer), "name": self.name, "rounds": self.rounds, "samples": self.samples,
                "compute_s": round(self.compute_s, 3), "bytes_sent": self.bytes_sent,
                "first_seen": self.first_seen, "last_seen": self.last_seen, "exclusions": self.exclusions,
                "exclusion_reasons": dict(self.reasons), "unconfirmed": self.unconfirmed}


def _by_group(signed: Iterable[Signed]) -> dict[tuple, dict[PeerID, Receipt]]:
    """Receipts by group, one per signer; a signer with two different bodies for a group is dropped."""
    bodies: dict[tuple, dict[PeerID, set[bytes]]] = defaultdict(lambda: defaultdict(set))
    found: dict[tuple, dict[PeerID, Receipt]] = defaultdict(dict)
    for s in signed:
        key = s.receipt.group_key
        bodies[key][s.receipt.signer].add(s.body)
        found[key][s.receipt.signer] = s.receipt
    return {key: {p: r for p, r in rs.items() if len(bodies[key][p]) == 1} for key, rs in found.items()}


def confirm(signed: Iterable[Signed]) -> tuple[list[Confirmed], set[tuple[str, str, PeerID]]]:
    """The lines a majority of their group signed (at most one per peer and round: its largest),
    and the (run, round, peer) whose lines no majority agreed on."""
    best: dict[tuple[str, str, PeerID], Confirmed] = {}
    seen: set[tuple[str, str, PeerID]] = set()
    for (run, rid, _gid, peers), receipts in _by_group(signed).items():
        need = len(peers) // 2 + 1
        for rank, peer in enumerate(peers):
            seen.add((run, rid, peer))
            votes = Counter(r.lines[rank] for r in receipts.values())
            line, count = max(votes.items(), key=lambda kv: (kv[1], kv[0].samples), default=(None, 0))
            if line is None or count < need:
                continue
            signers = [r for r in receipts.values() if r.lines[rank] == line]
            why = Counter(r.why[rank] for r in signers if rank in r.why).most_common(1)
            c = Confirmed(run, rid, line, statistics.median(r.time for r in signers),
                          why[0][0] if line.excluded and why else ("excluded" if line.excluded else None))
            old = best.get((run, rid, peer))
            if old is None or (line.samples, not line.excluded) > (old.line.samples, not old.line.excluded):
                best[(run, rid, peer)] = c
    return list(best.values()), seen - best.keys()


def leaderboard(signed: Iterable[Signed], names: Mapping[PeerID, str] | None = None,
                run: str | None = None) -> list[Row]:
    """One row per peer from ``signed`` receipts (only those of averaging prefix ``run`` when
    given; ``names``: the names peers announced), most samples first."""
    signed = [s for s in signed if run is None or s.receipt.run == run]
    counted, unconfirmed = confirm(signed)
    rows: dict[PeerID, Row] = {}

    def row(peer: PeerID) -> Row:
        if peer not in rows:
            rows[peer] = Row(peer, (names or {}).get(peer))
        return rows[peer]

    for c in counted:
        r = row(c.line.peer)
        r.rounds += 1
        r.samples += c.line.samples
        if c.line.excluded:
            r.exclusions += 1
            r.reasons[c.why or "excluded"] += 1
        r.first_seen = c.time if r.first_seen is None else min(r.first_seen, c.time)
        r.last_seen = c.time if r.last_seen is None else max(r.last_seen, c.time)
    for _run, _rid, peer in unconfirmed:
        row(peer).unconfirmed += 1
    own: dict[tuple[str, str, PeerID], Receipt] = {}
    for s in signed:
        own.setdefault((s.receipt.run, s.receipt.round_id, s.receipt.signer), s.receipt)
    for (_run, _rid, peer), rec in own.items():
        r = row(peer)
        r.compute_s += rec.compute_s
        r.bytes_sent += rec.bytes_sent
    return sorted(rows.values(), key=lambda r: (-r.samples, -r.rounds, str(r.peer)))
