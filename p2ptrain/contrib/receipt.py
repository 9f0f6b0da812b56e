"""Contribution receipts: what one averaging round credited each member of its group with, as one
member computed it and signed it (sans-IO: build, sign, parse and verify).

Gathering signatures without a round trip: after its round each member computes the receipt on its
own from the facts its group agreed on, signs it and publishes it in the background (see
:mod:`.book`); nothing in the round waits for it. Those facts: the members and the weights they
declared in matchmaking (owner-signed in the DHT, checked by every member), the aggregation rule,
and each owner's summary of whose whole part its shard's average holds, with the weight it counted
each with (the same summary goes to every sender). Per member the receipt holds one *line*:
``(peer, samples, excluded)``, where ``samples`` is the weight its part was counted with (declared,
capped by the group's weight cap and, under a robust rule, at the group's median; per shard, no
more than its owner reports counting it with) times the fraction of the vector whose average holds
its whole part (0 for an owner this member's audit named), and ``excluded`` says it was dropped or
missing. Beside the lines, the signer's own view and claims, not agreed: why it excluded whom (a
class: ``nan``, ``audit``, ``protocol``, ``lost``, ``missing``), its bytes sent and compute time.

A line counts (:mod:`.leaderboard`) only when a strict majority of the group's members signed
receipts holding that identical line. So a lying member

* cannot raise its own or anyone's counted line beyond what a majority of its group signed: its
  receipt is one signature of N; nor forge another's (Ed25519 over the body, checked against the
  signer's PeerID, which is its key); a signer that signs two different receipts for one group
  counts for neither;
* cannot lower an honest member's credit, or pin an exclusion on it, by inventing a group that
  names it: the leaderboard credits a member once per round, with its largest counted line;
* can withhold its signature or sign another view: in a pair (2 of 2 needed) that denies its
  partner the round's credit; in a larger group it takes a majority of the group;
* as a coalition holding a majority of a group, or with identities made up for the purpose
  (sybils) forming a group of their own, can credit themselves as they please: receipts say what a
  majority of a group vouched for, not that the group trained. In an open swarm the leaderboard
  is evidence against a lone liar, not against sybils (a private swarm key keeps strangers out);
* reports its own bytes sent and compute time: those are claims, shown as such.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dht import Identity, PeerID, ProtocolError, pack, unpack

from ..averaging import AllReduceResult

__all__ = ["Line", "MAX_BODY", "Receipt", "Signed", "build_receipt", "exclusion_class", "parse_signed", "sign"]

_VERSION = 1
DOMAIN = b"p2ptrain/receipt/1\n"  # signatures cover DOMAIN + body: a receipt's signature signs nothing else
MAX_BODY = 4096  # bytes of one receipt's body (a group of 16 takes about 1.1 KB)
MAX_GROUP = 64
_MAX_TEXT = 200  # run and round ids
CLASSES = ("nan", "audit", "protocol", "lost", "missing")


@dataclass(frozen=True)
class Line:
    """What a receipt credits one member with: the part of a receipt its group must agree on."""

    peer: PeerID
    samples: int
    excluded: bool


@dataclass(frozen=True)
class Receipt:
    """One member's receipt of one round: ``run`` (the averaging key prefix), ``round_id``, the
    group's id and one line per member in rank order; then the signer's own view and claims."""

    run: str
    round_id: str
    group_id: bytes
    lines: tuple[Line, ...]
    signer: PeerID
    time: float  # unix time the signer signed it
    why: dict[int, str] = field(default_factory=dict)  # rank -> exclusion class, as the signer saw it
    bytes_sent: int = 0  # the signer's claims
    compute_s: float = 0.0

    @property
    def group_key(self) -> tuple[str, str, bytes, tuple[PeerID, ...]]:
        """What identifies the group a receipt speaks of: receipts count together only under one key."""
        return self.run, self.round_id, self.group_id, tuple(line.peer for line in self.lines)

    def to_body(self) -> bytes:
        return pack({"v": _VERSION, "run": self.run, "r": self.round_id, "g": self.group_id,
                     "m": [[ln.peer.to_bytes(), ln.samples, ln.excluded] for ln in self.lines],
                     "t": self.time, "y": [[r, c] for r, c in sorted(self.why.items())],
                     "b": self.bytes_sent, "c": self.compute_s})

    @classmethod
    def from_body(cls, body: bytes, signer: PeerID) -> Receipt:
        """The receipt in ``body`` signed by ``signer``; ValueError if malformed or not from a member."""
        try:
            d = unpack(body, MAX_BODY)
        except ProtocolError:
            raise ValueError("not msgpack") from None
        if not isinstance(d, dict) or d.get("v") != _VERSION:
            raise ValueError("not a receipt of this version")
        run, rid, gid, m, t = d.get("run"), d.get("r"), d.get("g"), d.get("m"), d.get("t")
        b, c, y = d.get("b", 0), d.get("c", 0.0), d.get("y", [])
        if not (isinstance(run, str) and isinstance(rid, str) and 0 < len(run) <= _MAX_TEXT
                and len(rid) <= _MAX_TEXT and isinstance(gid, bytes) and 0 < len(gid) <= 64):
            raise ValueError("malformed run, round or group id")
        if not (isinstance(m, list) and 2 <= len(m) <= MAX_GROUP and isinstance(y, list)):
            raise ValueError("malformed member lines")
        lines = []
        for item in m:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], bytes)
                    and _count(item[1]) and isinstance(item[2], bool)):
                raise ValueError("malformed member line")
            lines.append(Line(PeerID(item[0]), item[1], item[2]))
        if len({ln.peer for ln in lines}) != len(lines) or signer not in {ln.peer for ln in lines}:
            raise ValueError("duplicate members, or signed by a peer not in the group")
        why = {}
        for item in y:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                    and 0 <= item[0] < len(lines) and item[1] in CLASSES):
                raise ValueError("malformed exclusion")
            why[item[0]] = item[1]
        if not (_real(t) and _count(b) and _real(c) and c >= 0):
            raise ValueError("malformed time, bytes or compute time")
        return cls(run, rid, gid, tuple(lines), signer, float(t), why, b, float(c))


@dataclass(frozen=True)
class Signed:
    """A receipt, the exact body its signer signed, and the signature."""

    receipt: Receipt
    body: bytes
    sig: bytes

    def to_wire(self) -> list:
        return [self.receipt.signer.to_bytes(), self.body, self.sig]


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sign(receipt: Receipt, identity: Identity) -> Signed:
    """``receipt`` signed by ``identity`` (which must be its signer)."""
    if identity.peer_id != receipt.signer:
        raise ValueError("a receipt is signed by its signer only")
    body = receipt.to_body()
    return Signed(receipt, body, identity.sign(DOMAIN + body))


def parse_signed(obj: object, signer: PeerID | None = None) -> Signed | None:
    """A signed receipt from its wire form ``[signer, body, signature]``; None if malformed, its
    signature does not verify, or it is not ``signer``'s (when given)."""
    if not (isinstance(obj, list) and len(obj) == 3 and all(isinstance(x, bytes) for x in obj)):
        return None
    raw, body, sig = obj
    try:
        by = PeerID(raw)
    except ValueError:
        return None
    if (signer is not None and by != signer) or len(body) > MAX_BODY or not by.verify(sig, DOMAIN + body):
        return None
    try:
        return Signed(Receipt.from_body(body, by), body, sig)
    except ValueError:
        return None


def exclusion_class(why: str) -> str:
    """The class of a round's reason for dropping a member (``AllReduceResult.failed``)."""
    low = why.lower()
    if "audit" in low:
        return "audit"
    if "nan" in low or " inf" in low:
        return "nan"
    if low.startswith("dropped"):
        return "protocol"
    return "lost"


def build_receipt(ar: AllReduceResult, run: str, round_id: str, signer: PeerID, now: float, *,
                  slices: Sequence[AllReduceResult] = (), failed: Mapping[int, str] | None = None,
                  bytes_sent: int = 0, compute_s: float = 0.0) -> Receipt:
    """Our receipt of round ``ar`` (``slices``: every all-reduce of a round averaged a slice at a
    time, ``ar`` the first; ``failed``: the round's failures, default ``ar.failed``), from the facts
    the group agreed on: see the module docstring."""
    failed = ar.failed if failed is None else failed
    shards = [s for r in (slices or [ar]) for s in r.shards]
    n = ar.group_size
    weights = list(ar.weights) if len(ar.weights) == n else [0.0] * n
    if ar.aggregation != "mean" and weights:  # robust rules cap each weight at the median (robust._capped)
        med = statistics.median_low(weights)
        weights = [min(w, med) for w in weights]
    total = sum(s.numel for s in shards)
    credit = [0.0] * n  # weight x values, over the shards whose average holds the member's whole part
    missing: set[int] = set()
    for s in shards:
        if s.status == "ok":
            for r in s.contributors:
                if 0 <= r < n:  # (as declared, but no more than the shard's owner counted it with)
                    credit[r] += min(weights[r], s.weights.get(r, weights[r])) * s.numel
            missing |= set(range(n)) - set(s.contributors)
    lines, why = [], {}
    for r, peer in enumerate(ar.members):
        cls = exclusion_class(failed[r]) if r in failed else ("missing" if r in missing else None)
        counted = 0 if cls == "audit" or not total else int(round(credit[r] / total))
        lines.append(Line(peer, counted, cls is not None))
        if cls is not None:
            why[r] = cls
    return Receipt(run, round_id, ar.group_id, tuple(lines), signer, now, why, int(bytes_sent), float(compute_s))
