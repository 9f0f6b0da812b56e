"""One peer's published progress (:class:`PeerReport`) and its wire form: what a peer claims of its
epoch, count, throughput and readiness, parsed so that a malformed record from a hostile peer is
dropped, never raised on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dht import Multiaddr, PeerID

from ..addresses import Reach, parse_addr, parse_relays

_VERSION = 1


@dataclass(frozen=True)
class PeerReport:
    """One peer's progress, as it published it."""

    peer: PeerID
    epoch: int
    samples: int  # accumulated toward ``epoch`` (sync) or since the last outer step (diloco)
    sps: float  # samples per second, measured while computing
    time: float  # unix time of the report
    schema: str  # hash of the averaged tensors' schema: peers with another one never average with us
    addr: tuple[str, int] | None = None  # where it serves state, direct; None behind NAT or in client mode
    ready: bool = False  # waiting to average the end of ``epoch``
    client: bool = False
    left: bool = False  # said goodbye: no longer counts, whatever its record's expiry
    #: updates its state holds (the label of the state it serves; behind ``epoch`` after a round it
    #: skipped or while one is in flight); None: not said
    held: int | None = None
    relays: tuple[Multiaddr, ...] = ()  # its circuit addresses (behind NAT), where it serves state too
    #: diloco: when it expects to end its inner phase (unix time), so that the peers of its cell
    #: end theirs then, not a notice or a poll later; None: not said
    eta: float | None = None

    @property
    def reach(self) -> Reach:
        """Where it serves state (falsy: nowhere, a client-mode peer)."""
        return Reach(self.addr, self.relays)

    def to_wire(self) -> dict[str, Any]:
        out = {"v": _VERSION, "e": self.epoch, "s": self.samples, "sps": self.sps, "t": self.time,
               "h": self.schema, "a": list(self.addr) if self.addr else None, "r": self.ready,
               "c": self.client, "l": self.left, "u": self.held}
        if self.eta is not None:
            out["f"] = self.eta
        return {**out, "ra": self.reach.relays_wire()} if self.relays else out


def parse_report(value: object, owner: PeerID) -> PeerReport | None:
    """A validated report, or None for anything malformed (a hostile peer may publish anything)."""
    if not isinstance(value, dict) or value.get("v") != _VERSION:
        return None
    e, s, sps, t, h, a, u, f = (value.get(k) for k in ("e", "s", "sps", "t", "h", "a", "u", "f"))
    if not (isinstance(e, int) and 0 <= e < 2**53 and isinstance(s, int) and 0 <= s < 2**53):
        return None
    if u is not None and not (type(u) is int and 0 <= u < 2**53):
        return None
    if not (isinstance(sps, (int, float)) and math.isfinite(sps) and 0 <= sps < 1e12):
        return None
    if not (isinstance(t, (int, float)) and math.isfinite(t)) or not (isinstance(h, str) and len(h) <= 64):
        return None
    if f is not None and not (isinstance(f, (int, float)) and math.isfinite(f)):
        return None
    try:
        addr, relays = parse_addr(a), parse_relays(value.get("ra", []), owner)
    except ValueError:
        return None
    return PeerReport(owner, e, s, float(sps), float(t), h, addr, value.get("r") is True, value.get("c") is True,
                      value.get("l") is True, u, relays, None if f is None else float(f))
