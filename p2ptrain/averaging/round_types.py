"""The all-reduce round's plain types: its configuration, its results, the codec id both ends
compare, the resources the service lends each round, and the exceptions its parts raise to each
other. A leaf: nothing here does I/O."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dht import MAX_FRAME_BODY, PeerID

from ..compression import Codec, CompressionError, ErrorFeedback
from ..errors import P2PTrainError

if TYPE_CHECKING:
    from dht import Host

__all__ = ["AllReduceConfig", "AllReduceResult", "Drop", "InputRefused", "PartialResult", "RoundResources",
           "ShardResult", "base_codec", "codec_id"]


@dataclass
class AllReduceConfig:
    chunk_numel: int = 1 << 20  # values per chunk (rounded up to a multiple of 256)
    #: the whole round, on this member; None: derived per round (``p2ptrain.deadlines.ROUND``)
    timeout: float | None = None
    reduce_fraction: float = 0.6  # owners stop waiting for senders after this fraction of timeout
    join_timeout: float = 5.0  # owners give up on senders that have not opened their stream by then
    stall_timeout: float = 5.0  # no progress on a stream for this long: the peer is stalled
    min_bandwidth: float = 10e6  # bytes/s floor used to scale the per-read timeout of big frames
    connect_timeout: float = 5.0
    max_weight: float = 1e12  # larger declared weights are hostile (they would overflow float32)
    #: rounds with at least this many values run codec work in the worker thread; None: never
    offload_min_numel: int | None = 1 << 18
    #: ... and only with this many CPUs: with no core to spare each chunk pays two thread hand-offs
    #: and GIL waits for nothing. allreduce_bench.py, N = 2, 256 MB, offloaded / inline: 2 cores none
    #: 0.337 / 0.299 s, int8 0.261 / 0.209 s; 4 cores a wash; 16 cores none 0.170 / 0.286 s.
    offload_min_cpus: int = 4

    def read_timeout(self, nbytes: int) -> float:
        return max(self.stall_timeout, 4.0 * min(nbytes, MAX_FRAME_BODY) / self.min_bandwidth)


@dataclass
class ShardResult:
    owner: int
    start: int
    end: int
    status: str = "failed"  # "ok": averaged; "failed": local values kept (beyond ``averaged``)
    averaged: int = 0  # values of [start, end) that hold the average (a prefix)
    contributors: list[int] = field(default_factory=list)  # ranks whose whole part is in the average
    partial: dict[int, int] = field(default_factory=dict)  # rank -> chunks of its part that made it
    weight: float = 0.0  # smallest per-chunk weight sum behind the averaged values
    #: rank -> the weight the owner counted a contributor's part with, as it reported it (receipts
    #: credit no more: a round begun early declared the most its members would have)
    weights: dict[int, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class AllReduceResult:
    group_id: bytes
    group_size: int
    members: tuple[PeerID, ...]
    rank: int
    shards: list[ShardResult]  # one per non-empty shard, in rank order
    failed: dict[int, str]  # rank -> why it was dropped / given up on (this member's view)
    weight_total: float  # smallest weight behind any value of flat (own weight if nothing averaged)
    bytes_sent: int = 0  # stream payload bytes, both phases
    bytes_received: int = 0
    time_total: float = 0.0
    time_reduce: float = 0.0
    time_gather: float = 0.0
    buffer_bytes: int = 0  # bytes of the buffers this round allocated (accumulator + chunk buffers)
    #: each member's weight as every member counts it, from the weights declared in matchmaking
    #: (``group.counted_weight``; 0.0 where none was declared): what contribution receipts credit,
    #: at most (no more than each shard's owner reports: ``ShardResult.weights``)
    weights: tuple[float, ...] = ()
    aggregation: str = "mean"

    @property
    def ok(self) -> bool:
        return all(s.status == "ok" for s in self.shards)

    @property
    def not_averaged(self) -> list[int]:
        """Owners whose shard was not (fully) averaged: those values are still local."""
        return [s.owner for s in self.shards if s.status != "ok"]

    @property
    def excluded(self) -> set[int]:
        """Ranks whose contribution is missing from at least one averaged shard."""
        out: set[int] = set()
        for s in self.shards:
            if s.status == "ok":
                out |= set(range(self.group_size)) - set(s.contributors)
        return out


def base_codec(codec: Codec) -> Codec:
    """The codec that sets the wire format (the one under an ErrorFeedback wrapper)."""
    return codec.codec if isinstance(codec, ErrorFeedback) else codec


def codec_id(codec: Codec) -> str:
    """Name and options of a codec, e.g. ``int8(block=256)``: both ends must agree on it."""
    b = base_codec(codec)
    return f"{b.name}({b._opts_repr()})"


class Drop(P2PTrainError):
    """A peer broke the protocol: drop it from the round."""


class InputRefused(P2PTrainError):
    """Our own input cannot be averaged (NaN/inf, found by the encode of a chunk we were sending or
    where our own shard was first read), ending our round: to the others we are a member that died."""


class PartialResult(CompressionError):
    """A reply chunk with a NaN/inf after ``done`` good values, which were copied (see ``_decode``)."""

    def __init__(self, done: int):
        super().__init__(f"none: received values contain NaN or inf (after {done} good values of the chunk)")
        self.done = done


@dataclass
class RoundResources:
    """What the service lends each of its rounds: built once by the service, handed to every round.
    ``before_chunk``, ``outgoing`` and ``reply`` call the service's extension points (its
    ``_before_chunk``, ``_outgoing``, ``_reply``), which do nothing unless replaced."""

    host: Host
    accept_wait: float  # how long a stream may wait for its round to start here
    cpus: int  # usable CPUs: codec work is offloaded to ``executor`` only with enough of them
    take_wire: Callable[[int], torch.Tensor]  # a uint8 buffer of at least n bytes, kept between rounds
    take_scratch: Callable[[int], torch.Tensor]  # a float32 buffer of exactly n values, kept the same way
    #: awaited before each chunk a sender writes (owner rank, chunk index)
    before_chunk: Callable[[int, int], Awaitable[None]]
    #: the wire bytes of each chunk a sender writes (owner rank, chunk index, views) -> views
    outgoing: Callable[[int, int, list[memoryview]], list[memoryview]]
    #: the reply bytes of each chunk of our shard an owner writes (chunk index, data) -> data
    reply: Callable[[int, Any], Any]
    executor: concurrent.futures.ThreadPoolExecutor | None = None  # ONE worker thread (FIFO: ordered work)
