"""Deadlines from measurement (sans-IO): how long an all-reduce round, a state load or a checkpoint
fetch may take, from this peer's own measured bandwidth and latency and the bytes it moves,
bounded by a floor and a ceiling. Until a bandwidth is measured each kind keeps the fixed value
it had before (its ``fallback``).

Only our own measurements count (a :class:`LinkMeter` fed with transfers we timed ourselves): a
bandwidth a peer declares is a claim, and believing it would let a liar shrink our deadline (we
give up on honest peers) or stretch it (we wait on it). A peer can still be slow, which lowers
our measured bandwidth and so lengthens our deadlines: the ceiling bounds that. The payload sizes
are our own too (our tensors, our state), or a signed record's size, which a fetch also enforces
(a manifest larger than its record is refused), so a small size cannot make us cut a fetch short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CHECKPOINT_FETCH", "MIN_SAMPLE_BYTES", "ROUND", "STATE_LOAD", "DeadlineRule", "LinkMeter", "resolve"]

#: transfers smaller than this say little about bandwidth (their time is mostly latency): not sampled
MIN_SAMPLE_BYTES = 1 << 20
_NEW = 0.3  # weight of the newest sample in the moving averages


@dataclass(frozen=True)
class DeadlineRule:
    """How one kind of deadline follows from a payload and a link:
    ``clamp(floor, slack * (latency * round_trips + payload / bandwidth) + margin, ceiling)``,
    and ``fallback`` while no bandwidth is known."""

    floor: float
    ceiling: float
    fallback: float
    round_trips: int = 4  # request/reply exchanges before the bytes flow (connect, handshake, ask)
    slack: float = 4.0  # times the expected time: a busy moment, a slower member of the group
    margin: float = 1.0  # seconds on top: scheduling, a worker thread to start

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.fallback <= self.ceiling < math.inf:
            raise ValueError("a deadline rule needs 0 < floor <= fallback <= ceiling < inf")

    def derive(self, payload_bytes: int, bandwidth: float | None, latency: float | None = None) -> float:
        """The deadline, in seconds, for moving ``payload_bytes`` over a link of ``bandwidth``
        bytes/s and ``latency`` seconds per round trip (None: not measured)."""
        if bandwidth is None or not 0 < bandwidth < math.inf:
            return self.fallback
        rtt = latency if latency is not None and 0 <= latency < math.inf else 0.0
        expected = rtt * self.round_trips + max(0, payload_bytes) / bandwidth
        return min(self.ceiling, max(self.floor, self.slack * expected + self.margin))


#: one all-reduce round on this member (its payload: the bytes it sends and receives)
ROUND = DeadlineRule(floor=30.0, ceiling=600.0, fallback=60.0)
#: a state load from peers, or a resume from the swarm's checkpoint (the state's bytes)
STATE_LOAD = DeadlineRule(floor=30.0, ceiling=1800.0, fallback=60.0)
#: a checkpoint fetch of its own (``p2ptrain ckpt fetch``, ``fetch_checkpoint``: the record's size)
CHECKPOINT_FETCH = DeadlineRule(floor=60.0, ceiling=3600.0, fallback=600.0)


class LinkMeter:
    """This peer's link as it measured it: moving averages of the throughput of transfers it
    completed (bytes/s, transfers of at least :data:`MIN_SAMPLE_BYTES`) and of its latency."""

    def __init__(self) -> None:
        self.bandwidth: float | None = None
        self.latency: float | None = None

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` (sent and received) that took ``seconds``, all told."""
        if nbytes >= MIN_SAMPLE_BYTES and 0 < seconds < math.inf:
            self.bandwidth = _average(self.bandwidth, nbytes / seconds)

    def observe_latency(self, seconds: float) -> None:
        """A round trip (or a DHT read, an overestimate of one) that took ``seconds``."""
        if 0 <= seconds < math.inf:
            self.latency = _average(self.latency, seconds)

    def deadline(self, rule: DeadlineRule, payload_bytes: int) -> float:
        return rule.derive(payload_bytes, self.bandwidth, self.latency)


def resolve(given: float | None, rule: DeadlineRule, payload_bytes: int, link: LinkMeter | None) -> float:
    """``given`` (the caller's explicit deadline) if any, else the one derived from ``link``."""
    if given is not None:
        return given
    return rule.fallback if link is None else link.deadline(rule, payload_bytes)


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _NEW) * old + _NEW * sample
