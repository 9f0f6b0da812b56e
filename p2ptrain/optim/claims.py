"""Which epoch claims to believe: a peer's progress record says where it is, and nothing checks it.

A peer that claims an epoch far ahead would make every honest peer think it fell behind and load
that peer's state, so a claim is believed only with evidence (sans-IO: reports in, verdicts out):

* **quorum**: the *quorum epoch* is the highest epoch that a strict majority of the distinct peers
  we hear from (reports younger than ``live_window``: a dead peer's record lingers) are at or past
  (us included once we hold state of our own: a fresh joiner at epoch 0 has no say). A claim is
  believed up to ``slack`` epochs past it, plus what the swarm trains in ``live_window`` at the
  median peer's samples/s (reports lag their peers by up to a refresh, and fast epochs spread them
  apart; a minority cannot move the median);
* **rate** (``mean`` only): a claim further ahead is still believed when the peer got there from an
  epoch the quorum believed, no faster than the swarm's throughput allows: ``rate_factor`` times
  (our measured samples/s x the peers we hear from) / samples per epoch. It lets a small swarm whose
  peers drift apart (two peers, one stalled) keep following the one ahead; under a robust rule only
  the quorum counts, as a minority must not steer anything.

A refused claimant is left out of the swarm's view (the caller ignores it for a while) and named.
A majority of hostile identities defeats the quorum: that is what a swarm key (who may join) is for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dht import PeerID

from .progress import PeerReport


@dataclass
class _Anchor:
    epoch: int  # the last epoch of this peer's that we believed
    time: float  # when


class EpochJudge:
    """Verdicts on the epochs peers claim; keep one per optimizer (it remembers what it believed)."""

    def __init__(self, *, strict: bool, slack: int = 1, rate_factor: float = 8.0, live_window: float = 3.0,
                 max_peers: int = 10_000):
        self.strict = strict
        self.live_window = live_window
        self.slack = slack
        self.rate_factor = rate_factor
        self.max_peers = max_peers
        self._anchors: dict[PeerID, _Anchor] = {}

    @staticmethod
    def quorum_epoch(epochs: list[int]) -> int:
        """The highest epoch a strict majority of ``epochs`` are at or past."""
        ranked = sorted(epochs, reverse=True)
        return ranked[len(ranked) // 2]

    def judge(self, reports: Iterable[PeerReport], me: PeerReport, *, counts_me: bool, now: float,
              my_sps: float, samples_per_epoch: int) -> dict[PeerID, str]:
        """The peers of ``reports`` (their latest, same run) whose epoch is not believed, with why."""
        latest: dict[PeerID, PeerReport] = {}
        for r in reports:
            if r.peer != me.peer and (r.peer not in latest or r.time > latest[r.peer].time):
                latest[r.peer] = r
        live = [r for r in latest.values() if now - r.time <= self.live_window]
        if not live:
            return {}
        epochs = [r.epoch for r in live] + ([me.epoch] if counts_me else [])
        quorum = self.quorum_epoch(epochs)
        speeds = sorted(r.sps for r in live)  # (the lower median: with two peers, the slower one's)
        lag = self.live_window * speeds[(len(speeds) - 1) // 2] * len(epochs) / max(1, samples_per_epoch)
        limit = quorum + self.slack + int(lag)
        # epochs per second the swarm could train: our own measured throughput as the yardstick
        rate = self.rate_factor * max(my_sps, 0.0) * len(epochs) / max(1, samples_per_epoch)
        refused: dict[PeerID, str] = {}
        for peer, r in latest.items():
            anchor = self._anchors.get(peer)
            if r.epoch <= limit:
                if anchor is not None or len(self._anchors) < self.max_peers:
                    self._anchors[peer] = _Anchor(r.epoch, now)
                continue
            if not self.strict and anchor is not None and \
                    r.epoch - anchor.epoch <= self.slack + rate * max(0.0, now - anchor.time):
                continue  # ran ahead, but no faster than the swarm trains
            refused[peer] = (f"claims epoch {r.epoch}, but most of the {len(epochs)} peers we hear from are at "
                             f"{quorum} or before" + ("" if self.strict or anchor is None else
                                                      f" and it was at {anchor.epoch} {now - anchor.time:.0f} s ago"))
        return refused
