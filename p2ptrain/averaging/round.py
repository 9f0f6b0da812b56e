"""One round of the fault-tolerant, compressed, pipelined butterfly all-reduce (reduce-scatter +
all-gather) among the members of an already-formed :class:`~p2ptrain.averaging.group.Group`: the
protocol, the configuration and result types, and ``_Round``, the state machine of one member's
part in one round (owner side and sender side). :mod:`.allreduce` runs rounds: its
``AllReduceService`` owns the stream handler, the registry of rounds, the worker thread and the
buffers kept between rounds.

Protocol ``p2ptrain/allreduce/1``
---------------------------------
Every member owns the shard ``partition(numel, members)[rank]`` of the flat float32 vector (sized by
declared bandwidth; client-mode members own nothing). For every ordered pair (sender i, owner j),
i != j, j's shard non-empty, i opens ONE bidirectional stream to j with the header
``{"g": group_id, "from": i, "w": weight, "n": numel, "codec": id, "gcodec": id}`` and

* reduce: writes its part ``flat[start_j:end_j]`` chunk by chunk (``chunk_numel`` values, the last
  shorter), each chunk exactly ``codec.encoded_nbytes(chunk_numel)`` bytes, then half-closes (EOF).
  The codec meta is derived locally on both sides, never read from the wire.
* gather: reads the reply: ``u32 length | msgpack summary`` (who contributed, weight sum), then the
  averaged part, chunk by chunk in the gather codec, then EOF; decoded straight into ``flat``.

The owner reads each chunk into one reusable buffer of the exact size and ``decode_add``s it into a
float32 accumulator for its shard (the only shard-sized allocation) with the sender's weight, and
adds that weight to the chunk's weight sum, so a sender that dies half-way contributes exactly the
chunks it completed: chunk c averages to ``acc_c / wsum_c``. The owner's own part enters with its
own weight (exactly, never through the codec). When every expected sender has finished, failed or
missed its deadline, the owner divides, encodes each averaged chunk once (and decodes it into its
own ``flat``, so every member ends with bit-identical values), and writes it to every sender whose
part arrived complete.

Robust aggregation
------------------
``run(..., aggregation="trimmed_mean" | "median" | "centered_clip")`` (:mod:`.robust`) replaces the
streaming weighted mean, which one hostile sender moves anywhere. The owner decodes each sender's
chunk into its row of a slot ``[group size, chunk_numel]`` and, once every expected sender delivered
chunk c (or failed, or was given up on), combines the rows (its own included) in the worker, in
chunk order. With ``ROBUST_WINDOW`` (2) slots a sender may store chunk c only after chunk c - 2 is
combined (else its stream waits): the buffers beside the accumulator stay within
``2 * size * chunk_numel * 4`` bytes (64 MiB at 8 members, default chunk). The rule's name travels
in the header (``"agg"``, absent for ``mean``): a mismatch drops the sender like a codec mismatch.
Weights are capped at the median, and after the round each member audits the other owners' results
(:mod:`.audit`): an owner cannot set the others' values beyond what the rule allows. Under any rule
a sender's weight counts at most what it declared in matchmaking and ``MAX_WEIGHT_RATIO`` times the
group's median declared weight (:func:`.group.weight_cap`).

Failures
--------
* owner dies / resets / stalls: the sender keeps its local values for that shard (the chunks already
  received back stay averaged: ``ShardResult.averaged`` says how many values) and the shard is
  reported ``failed`` with the reason.
* owner replies with something that fails validation (NaN/inf, too short or long): dropped like a
  dead owner; the chunks it sent back before stay averaged (with a ``none`` reply, also the 16 KiB
  pieces of the bad chunk before the first NaN/inf: ``averaged`` counts them).
* sender dies / stalls: the owner averages over what arrived (per chunk) and sends nothing back to it.
* hostile sender (malformed header, weight non-finite/<=0/too large, numel or codec mismatch, a chunk
  that fails to decode, finite values whose weighted sum could overflow float32, too little or too
  much data, not a member, duplicate stream): dropped. Rule:
  chunks it sent *before* the violation stay in the average (they were individually validated: right
  size, finite, decodable, bounded); everything after is excluded; it gets no reply and is listed in
  ``failed``. Excluding its earlier chunks too would need per-sender accumulators (unbounded memory).
* our own input holds NaN/inf: ``run`` refuses it before anything is sent, except with ``int8``
  (see "Own values"), where it ends the round when found (CompressionError): to the others we are
  a member that died mid-round.
* stalls: every read/write waits at most ``max(stall_timeout, 4 * frame_bytes / min_bandwidth)``
  for progress; an owner stops waiting for senders that have not opened their stream after
  ``join_timeout`` and for any sender at ``reduce_fraction * timeout``; the whole run is capped at
  ``timeout``.

Own values
----------
``run`` reads the whole input once before the round to refuse NaN/inf and to bound our own values
(the sum's overflow check below), except with a codec whose encode refuses NaN/inf in the pass
that reads each chunk (``int8``): then nothing is read up front. What we send is checked by its
encode; our own shard where the round first reads each of its chunks, the first contribution's
``decode_add_base``, which measures max |own| in the pass that adds to it (or, for a chunk nobody
contributed to, a check before its reply is encoded). Until then a chunk's own values count as
half the sum's limit. A NaN/inf, or own values so large that the first contribution could
overflow the sum, ends our round with CompressionError, and ``flat`` is left as a cancelled round
leaves it. Why: at N = 2 the check of our own shard was 7% of an int8 round (256 MB, loopback).

Streams can arrive before the local round for that group is registered (members learn of the group
at slightly different times): the handler waits up to ``accept_wait`` seconds for ``run`` to start.

Concurrency: one event loop; a task per outgoing part and per incoming sender; codec work on large
rounds goes to ONE worker thread (torch releases the GIL), which also makes accumulation and the
final division strictly ordered (FIFO) without locks; on a process with fewer than
``offload_min_cpus`` CPUs it runs inline on the loop instead (no core to overlap with).

Hot path (measured, see benchmarks/allreduce_bench.py): with the default 1M-value chunks a float32
chunk is one 4 MiB stream frame, read as one zero-copy view of the decrypted frame. For ``none``
the sender writes views of ``flat`` (``run`` checked it is finite; no encode pass), the owner
keeps a running weighted mean of each chunk in ``flat`` itself (one ``lerp`` pass per
contribution, no division pass) and sends views of it back; other codecs' shard accumulator is
kept by the service for the next round (a fresh one costs a page fault per 4 KiB). With ``int8``
both ways (and the compiled kernels) the owner sums in ``flat`` too, and the contribution that
completes a chunk (every expected sender's) is added and the chunk's reply encoded in one pass
(``Codec.decode_add_encode``): the reply waits, encoded, in a buffer of a quarter of the shard
until the replies go out, where summing and then encoding at the end crossed memory twice more
(N = 2: 8% of a round). Replies land in ``flat`` with streaming stores where ``flat`` is larger
than the last-level cache (``kernels.stream_worthwhile``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from dht.aio import wait_event
from dht.errors import DHTError, ProtocolError
from dht.identity import PeerID
from dht.stream import Stream
from dht.wire import MAX_FRAME_BODY, pack, unpack

from ..compression import Codec, CompressionError, ErrorFeedback, kernels
from ..compression.base import abs_max, check_finite, frombuffer
from ..compression.float import NoneCodec
from ..compression.int8 import Int8Codec
from .group import Group, counted_weight, partition, weight_cap
from .ledger import chunks as _chunks
from .robust import aggregate

if TYPE_CHECKING:
    from .allreduce import AllReduceService
    from .ledger import Ledger

__all__ = ["PROTOCOL", "AllReduceConfig", "AllReduceResult", "ShardResult", "codec_id"]

log = logging.getLogger("p2ptrain.allreduce")

PROTOCOL = "p2ptrain/allreduce/1"
_PREFIX = struct.Struct(">I")
MAX_SUMMARY = 1 << 16
_HEADER_KEYS = frozenset({"g", "from", "w", "n", "codec", "gcodec"})
_HEADER_KEYS_AGG = _HEADER_KEYS | {"agg"}  # "agg" is sent only for a robust aggregation
#: robust aggregation: chunks a sender may have buffered at the owner ahead of the last combined one
ROBUST_WINDOW = 2
_EMPTY = torch.empty(0, dtype=torch.float32)


@dataclass
class AllReduceConfig:
    chunk_numel: int = 1 << 20  # values per chunk (rounded up to a multiple of 256)
    timeout: float = 60.0  # the whole round, on this member
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


def _base(codec: Codec) -> Codec:
    return codec.codec if isinstance(codec, ErrorFeedback) else codec


def codec_id(codec: Codec) -> str:
    """Name and options of a codec, e.g. ``int8(block=256)``: both ends must agree on it."""
    b = _base(codec)
    return f"{b.name}({b._opts_repr()})"


class _Drop(Exception):
    """A peer broke the protocol: drop it from the round."""


class _InputRefused(Exception):
    """Our own input cannot be averaged (NaN/inf, found by the encode of a chunk we were sending or
    where our own shard was first read), ending our round: to the others we are a member that died."""


class _PartialResult(CompressionError):
    """A reply chunk with a NaN/inf after ``done`` good values, which were copied (see ``_decode``)."""

    def __init__(self, done: int):
        super().__init__(f"none: received values contain NaN or inf (after {done} good values of the chunk)")
        self.done = done


class _Reader:
    """Exact-size reads over a stream's frames, whatever their boundaries (a remainder is kept).
    ``read_exact`` hands out zero-copy views of received frames; only a read spanning frames copies,
    into a buffer allocated at that first need (a zero-filled multi-MiB bytearray per stream per
    round was a third of an N=8 round's CPU time, for a copy that rarely happens)."""

    __slots__ = ("stream", "_rest", "_buf", "max_bytes")

    def __init__(self, stream: Stream, max_bytes: int = 0):
        self.stream = stream
        self._rest: memoryview | None = None
        self._buf: memoryview | None = None
        self.max_bytes = max_bytes  # the largest read_exact; the size of the fallback buffer

    @property
    def allocated(self) -> int:
        return len(self._buf) if self._buf is not None else 0

    async def readinto(self, buf: memoryview, timeout: float) -> int:
        n, filled, rest = len(buf), 0, self._rest
        while filled < n:
            if rest is None:
                rest = await self.stream.read(timeout)
                if rest is None:
                    break
            k = min(len(rest), n - filled)
            buf[filled : filled + k] = rest[:k]
            filled += k
            rest = rest[k:] if k < len(rest) else None
        self._rest = rest
        return filled

    async def read_exact(self, n: int, timeout: float) -> memoryview | None:
        """``n`` (<= ``max_bytes``) bytes: a zero-copy view of the received frame when one frame
        holds them all, else a copy in the reader's own buffer (valid until the next read); None
        if the stream ended first."""
        rest = self._rest
        while rest is None:
            rest = await self.stream.read(timeout)
            if rest is None:
                return None
            if not len(rest):
                rest = None
        if len(rest) >= n:
            self._rest = rest[n:] if len(rest) > n else None
            return rest[:n]
        self._rest = rest
        if self._buf is None:
            self._buf = memoryview(bytearray(max(n, self.max_bytes)))
        buf = self._buf[:n]
        return buf if await self.readinto(buf, timeout) == n else None

    async def at_eof(self, timeout: float) -> bool:
        if self._rest is not None:
            return False
        while True:
            chunk = await self.stream.read(timeout)
            if chunk is None:
                return True
            if len(chunk):
                self._rest = chunk
                return False


@dataclass(eq=False)
class _Incoming:
    rank: int
    stream: Stream
    weight: float
    done: int = 0  # chunks accumulated (always a prefix)
    state: str = "receiving"  # "complete" | "failed"
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set when the reply is written


#: gather codecs whose encode never fails on finite values: owners may sum in place (see _Round)
_IN_PLACE_GATHER = ("none", "int8", "int8-outlier")

#: the largest |sum| an owner's float32 accumulator may reach: half of float32's max leaves room
#: for the rounding of every addition, so a sum checked against it never overflows to inf
_SUM_LIMIT = float(torch.finfo(torch.float32).max) / 2


def _retrieve(fut: asyncio.Future | None) -> None:
    """Cancel a prefetch nobody will await (no 'exception was never retrieved' reports)."""
    if fut is not None and not fut.cancel() and fut.done() and not fut.cancelled():
        fut.exception()


class _Round:
    def __init__(self, svc: AllReduceService, group: Group, rank: int, flat: torch.Tensor, weight: float,
                 codec: Codec, gcodec: Codec, cfg: AllReduceConfig, aggregation: str = "mean",
                 absmax: float | None = 0.0):
        weight = counted_weight(group.members[rank], weight, weight_cap(group.members, weight))  # as others count it
        self.svc, self.group, self.rank, self.flat, self.weight, self.cfg = svc, group, rank, flat, weight, cfg
        self.codec, self.gcodec = codec, gcodec
        # None: ``run`` did not check ``flat``: the encodes of what we send check it, and our own
        # shard is checked where it is first read (see "Own values" in the module docstring)
        self.input_checked = absmax is not None
        self.refused: _InputRefused | None = None  # our own shard failed that check
        self.rmeta, self.gmeta = _base(codec)._meta(_EMPTY), gcodec._meta(_EMPTY)
        self.n = n = flat.numel()
        self.size = group.size
        self.cn = -(-max(1, int(cfg.chunk_numel)) // 256) * 256
        self.bounds = partition(n, group.members) if n else [(0, 0)] * group.size
        self.offload = (cfg.offload_min_numel is not None and n >= cfg.offload_min_numel
                        and svc.cpus >= cfg.offload_min_cpus)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.timeout
        self.header = {"g": group.group_id, "from": rank, "w": float(weight), "n": n,
                       "codec": codec_id(codec), "gcodec": codec_id(gcodec)}
        self.agg = aggregation
        self.robust = aggregation != "mean"
        if self.robust:
            self.header["agg"] = aggregation
        s, e = self.bounds[rank]
        self.my_start, self.my_end = s, e
        self.my_chunks = _chunks(s, e, self.cn)
        self.is_owner = e > s
        self.expected = {r for r in range(self.size) if r != rank} if self.is_owner else set()
        self.incoming: dict[int, _Incoming] = {}
        self.failed: dict[int, str] = {}  # for the report: any rank we gave up on, either role
        self.rejected: set[int] = set()  # owner side: senders whose stream we no longer accept
        self.changed = asyncio.Event()
        self.reduce_closed = False
        self.buffer_bytes = 0
        self.bytes_sent = self.bytes_received = 0
        self.t_reduce = 0.0
        # ``none`` on float32 (no error feedback): a chunk's wire bytes are its values. ``run`` checked
        # ``flat`` is finite, so the sender sends views of it (no encode pass, no worker hop) and the
        # owner folds its own weighted values into the first foreign contribution in one pass.
        self.raw = type(codec) is NoneCodec
        # ``none`` replies: checked and copied into ``flat`` in one pass (see ``_decode``)
        self.raw_reply = type(gcodec) is NoneCodec and kernels.AVAILABLE
        # Replies go into ``flat`` and nothing in the round reads them again: where ``flat`` outgrows
        # the last-level cache they are written around it (streaming stores: no read before write).
        self.stream_out = kernels.stream_worthwhile(flat.numel() * flat.element_size())
        self.gdecoder = gcodec
        if self.stream_out and not isinstance(gcodec, ErrorFeedback):
            self.gdecoder = copy.copy(gcodec)
            self.gdecoder.stream_decoded = True
        self.acc_in_place = self.running_mean = False
        self.wires: list[torch.Tensor] = []  # wire buffers taken from the service's pool
        self._nbytes: dict[tuple[int, int], int] = {}
        self.replies: dict[int, torch.Tensor] | None = None  # int8 owners: replies made early (below)
        if self.is_owner:
            # The accumulator, filled lazily chunk by chunk (in the worker, pipelined with the
            # network), from our own values at the first foreign contribution (see _accumulate).
            # A chunk nobody else contributed to keeps its exact local values.
            if not self.robust and _base(gcodec).name in _IN_PLACE_GATHER:
                # ``_accumulate`` checks every payload (valid, finite, no overflow) before
                # decode_add writes anything, nobody else reads our own shard of ``flat`` during
                # the round, and the reply's encode cannot fail on a finite sum (``none``, ``int8``;
                # fp16 can, after the division already rewrote flat): accumulate in flat[s:e]
                # itself. No second shard-sized buffer, and about a third less memory traffic than
                # a separate accumulator (written, then divided back into flat).
                self.acc = flat[s:e]
                self.acc_in_place = True
            else:
                # Robust rules need our own row at combine time, and an fp16/bf16 reply may fail to
                # encode: flat[s:e] stays untouched until the division.
                self.acc = svc._take_scratch(e - s)
                self.buffer_bytes += self.acc.numel() * 4
            self.wsum = [float(weight)] * len(self.my_chunks)
            self.count = [1] * len(self.my_chunks)
            # ``none`` both ways, accumulated in flat: each contribution moves the chunk's weighted
            # mean toward its values (one lerp pass, as cheap as the add it replaces), so the
            # average is ready when the last one arrives and the reply needs no division pass. A
            # lerp of two values within _SUM_LIMIT cannot overflow; own values beyond it (never,
            # in practice) keep the sum-then-divide path.
            self.running_mean = (self.raw and self.acc_in_place and type(gcodec) is NoneCodec and absmax is not None
                                 and absmax <= _SUM_LIMIT)
            if self.robust:
                # Per-sender chunk buffers: ROBUST_WINDOW slots of [group size, chunk] decoded
                # float32 values (a sender may store chunk c only once chunk c - ROBUST_WINDOW is
                # combined), so the bound is ROBUST_WINDOW * size * chunk_numel * 4 bytes, whatever
                # the shard size. Row ``rank`` of a slot takes our own values at combine time.
                self.slots = torch.empty(ROBUST_WINDOW, self.size, min(self.cn, e - s), dtype=torch.float32)
                self.buffer_bytes += self.slots.numel() * 4
            else:
                # Per chunk, a bound on |sum| of what the accumulator holds (own values at ratio 1
                # to start): a contribution that could push it past _SUM_LIMIT is refused before
                # it is added, so the sum never overflows, a hostile sender's finite but huge
                # values cannot make our shard fail (or, summed in place, turn our own values into
                # inf), and the division needs no finiteness pass. The checks already done
                # (add_bound) make the decoder's own finiteness pass redundant: ``adder`` skips it.
                # Own values not measured yet (``absmax`` None) count as half the limit until the
                # first contribution to their chunk measures them.
                self.bound = [_SUM_LIMIT / 2 if absmax is None else float(absmax)] * len(self.my_chunks)
                self.adder = copy.copy(_base(codec))
                self.adder.check_finite_on_decode = False
                # int8 both ways, with the kernels: the contribution that completes a chunk is added
                # and the chunk's reply encoded in one pass over it (``decode_add_encode``: the
                # chunk crosses memory twice, not four times), the reply kept in ``reply_wire``
                # (a quarter of the shard) until the replies go out; ``_finalize`` sends it as is.
                if (kernels.AVAILABLE and self.acc_in_place and type(self.adder) is Int8Codec
                        and type(gcodec) is Int8Codec and self.adder.block == gcodec.block):
                    self.replies = {}
                    self.reply_stride = self._enc_nbytes(gcodec, min(self.cn, e - s))  # (one full chunk's)
                    self.reply_wire = svc._take_wire(self.reply_stride * len(self.my_chunks))
                    self.wires.append(self.reply_wire)
                    self.buffer_bytes += self.reply_wire.numel()
        self.combined = 0  # robust: chunks of our shard combined so far (a prefix)
        self.combined_ev = asyncio.Event()  # set when ``combined`` grows or the reduce closes
        self.own_shard: ShardResult | None = None
        self.wcap = weight_cap(group.members, weight)  # the most a sender's weight counts for (group.py)
        self.ledger: Ledger | None = None  # robust rules: what we keep for auditors (set by the service)

    def _enc_nbytes(self, codec: Codec, numel: int) -> int:
        key = (id(codec), numel)
        nb = self._nbytes.get(key)
        if nb is None:
            nb = self._nbytes[key] = codec.encoded_nbytes(numel)
        return nb

    # ------------------------------------------------------------------ helpers
    async def _compute(self, fn: Callable, *args: Any) -> Any:
        if self.offload:
            return await asyncio.get_running_loop().run_in_executor(self.svc._executor, fn, *args)
        return fn(*args)

    def _submit(self, fn: Callable, *args: Any) -> asyncio.Future:
        if self.offload:
            return asyncio.get_running_loop().run_in_executor(self.svc._executor, fn, *args)
        return self._inline(fn, *args)

    def _inline(self, fn: Callable, *args: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def _fail(self, rank: int, reason: str) -> None:
        if rank not in self.failed:
            self.failed[rank] = reason
            log.info("all-reduce %s: rank %d: %s", self.group.group_id.hex()[:8], rank, reason)

    def _account(self, stream: Stream) -> None:
        self.bytes_sent += stream.bytes_sent
        self.bytes_received += stream.bytes_received

    # ------------------------------------------------------------------ owner: one task per sender
    def _check_header(self, hdr: Any, rank: int) -> str | None:
        if not isinstance(hdr, dict) or (set(hdr) != _HEADER_KEYS and set(hdr) != _HEADER_KEYS_AGG):
            return "malformed header"
        w, n, frm = hdr["w"], hdr["n"], hdr["from"]
        if isinstance(frm, bool) or frm != rank:
            return f"header claims rank {frm!r:.20}, its peer id is rank {rank}"
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 < w <= self.cfg.max_weight):
            return f"bad weight {w!r:.30} (must be finite, > 0 and <= {self.cfg.max_weight:g})"
        if isinstance(n, bool) or n != self.n:
            return f"numel {n!r:.30} differs from ours ({self.n})"
        if hdr["codec"] != self.header["codec"] or hdr["gcodec"] != self.header["gcodec"]:
            return f"codec {hdr['codec']!r:.40}/{hdr['gcodec']!r:.40} differs from ours"
        if hdr.get("agg", "mean") != self.agg:
            return f"aggregation {hdr.get('agg', 'mean')!r:.40} differs from ours ({self.agg})"
        return None

    # ------------------------------------------------------------------ owner: robust aggregation
    def _store(self, inc: _Incoming, ci: int, buf: memoryview) -> bool:
        # Robust counterpart of _accumulate (worker thread or inline): decode the chunk into the
        # sender's row of the chunk's slot; combined later by _combine.
        if self.reduce_closed or inc.state != "receiving":
            return False
        a, b = self.my_chunks[ci]
        row = self.slots[ci % ROBUST_WINDOW, inc.rank, : b - a]
        _base(self.codec).decode(dict(self.rmeta, numel=b - a), buf, out=row)
        check_finite(row, "received chunk")  # whatever the codec's own option: NaN/inf never enter
        inc.done = ci + 1
        return True

    def _chunk_ready(self, ci: int) -> bool:
        """Every expected sender has delivered chunk ``ci``, or will never deliver it."""
        if self.expected - self.incoming.keys() - self.rejected:
            return False
        return all(i.state != "receiving" or i.done > ci for i in list(self.incoming.values()))

    def _combine(self, ci: int) -> None:
        # Worker thread (after every store submitted before it) or inline.
        a, b = self.my_chunks[ci]
        ranks = sorted(i.rank for i in list(self.incoming.values()) if i.done > ci)
        if not ranks:
            return  # only our own values: count stays 1, _finalize keeps them exactly
        slot = self.slots[ci % ROBUST_WINDOW, :, : b - a]
        slot[self.rank].copy_(self.flat[a:b])
        rows = sorted(ranks + [self.rank])
        x = slot if len(rows) == self.size else slot[rows]
        w = torch.tensor([self.weight if r == self.rank else self.incoming[r].weight for r in rows],
                         dtype=torch.float32)
        aggregate(self.agg, x, w, out=self.acc[a - self.my_start : b - self.my_start])
        if self.ledger is not None:
            self.ledger.combined(ci, rows, x, w)
        self.wsum[ci] = float(w.sum())
        self.count[ci] = len(rows)

    async def _combine_ready(self) -> None:
        """Combine, in order, every chunk all senders are done with (all of them once the reduce
        closed), freeing slots for the senders waiting in ``_slot_free``."""
        while self.combined < len(self.my_chunks) and (self.reduce_closed or self._chunk_ready(self.combined)):
            await self._compute(self._combine, self.combined)
            self.combined += 1
            self.combined_ev.set()

    async def _slot_free(self, ci: int) -> None:
        """Wait until chunk ``ci``'s slot is free (chunk ``ci - ROBUST_WINDOW`` combined)."""
        while self.combined <= ci - ROBUST_WINDOW and not self.reduce_closed:
            self.combined_ev.clear()
            if not await wait_event(self.combined_ev, max(0.0, self.deadline - time.monotonic())):
                raise _Drop("round deadline: still sending")

    def _accumulate(self, inc: _Incoming, ci: int, buf: memoryview) -> bool:
        # Runs in the worker thread (or inline): add + bookkeeping are one step, ordered before the
        # division, which is submitted to the same single thread after ``reduce_closed`` is set.
        if self.reduce_closed or inc.state != "receiving":
            return False
        a, b = self.my_chunks[ci]
        acc = self.acc[a - self.my_start : b - self.my_start]
        # acc holds sum_i (w_i / w_own) * x_i with our own values at ratio 1 (``_finalize`` divides
        # by wsum / w_own): starting it from our own values then needs no multiply pass. The first
        # foreign contribution writes acc = own + ratio * theirs in one pass; a message that fails
        # validation leaves acc untouched and never counts (a chunk still at count 1 keeps flat).
        # With ``running_mean``, acc holds the weighted mean itself (see __init__).
        meta = dict(self.rmeta, numel=b - a)
        if self.running_mean:
            top = self.codec.add_bound(meta, buf)  # validates: NaN/inf and malformed raise
            if not top <= _SUM_LIMIT:
                raise CompressionError(f"values up to {top:.3g} would overflow the float32 mean")
            wsum = self.wsum[ci] + inc.weight
            torch.lerp(acc, frombuffer(buf, torch.float32, 0, b - a), inc.weight / wsum, out=acc)
            self.wsum[ci] = wsum
            self.count[ci] += 1
            inc.done = ci + 1
            return True
        ratio = inc.weight / self.weight
        grow = self.codec.add_bound(meta, buf) * ratio  # validates: NaN/inf and malformed raise
        if not self.bound[ci] + grow <= _SUM_LIMIT:
            raise CompressionError(f"values up to {grow / ratio:.3g} at weight {inc.weight:.3g} would overflow "
                                   f"the float32 sum")
        last = self.replies is not None and self.count[ci] == len(self.expected)
        measure = self.count[ci] == 1 and not self.input_checked  # our own values, read in this pass
        if last:  # the chunk's last contribution: the sum and the reply's encoding in one pass
            wire, own = self.adder.decode_add_encode(meta, buf, acc, ratio, self.weight / (self.wsum[ci] + inc.weight),
                                                     self.reply_wire[ci * self.reply_stride : (ci + 1) * self.reply_stride])
        elif measure:
            own = self.adder.decode_add_base(meta, buf, acc, ratio, self.flat[a:b])
        else:
            self.adder.decode_add(meta, buf, acc, ratio, base=self.flat[a:b] if self.count[ci] == 1 else None)
        if measure:
            if not own + grow <= _SUM_LIMIT:  # (NaN compares false)
                raise _InputRefused(self._own_error(own, a, b, grow))
            self.bound[ci] = own + grow
        else:
            self.bound[ci] += grow
        if last:
            if wire is None:  # (cannot happen: the bound keeps the sum finite)
                raise CompressionError(f"the average of flat[{a}:{b}] does not encode")
            self.replies[ci] = wire
        self.wsum[ci] += inc.weight
        self.count[ci] += 1
        inc.done = ci + 1
        return True

    @staticmethod
    def _own_error(own: float, a: int, b: int, grow: float = 0.0) -> str:
        where = f"flat[{a}:{b}] (in our own shard)"
        if not own < float("inf"):
            return f"{where} contains NaN or inf"
        return (f"{where} holds values up to {own:.3g}, which the group's float32 sum could overflow (with "
                f"a contribution of up to {grow:.3g})")

    async def serve_sender(self, stream: Stream) -> None:
        try:
            rank = self.group.rank_of(stream.peer_id)
        except KeyError:
            stream.reset("not a member of this group")
            return
        if not self.is_owner or rank == self.rank:
            stream.reset("this member owns no shard")
            return
        if rank in self.incoming or rank in self.rejected or self.reduce_closed:
            stream.reset("duplicate or late stream")
            return
        bad = self._check_header(stream.header, rank)
        if bad:
            self.rejected.add(rank)
            self._fail(rank, f"dropped: {bad}")
            stream.reset(bad)
            self.changed.set()
            return
        inc = _Incoming(rank, stream, counted_weight(self.group.members[rank], float(stream.header["w"]), self.wcap))
        self.incoming[rank] = inc
        try:
            await self._receive(inc)
            await inc.finished.wait()  # the owner writes the reply, then sets this
        finally:
            if inc.state == "receiving":
                inc.state = "failed"
                self._fail(rank, "connection closed while sending")
            self.changed.set()
            inc.finished.set()

    async def _receive(self, inc: _Incoming) -> None:
        nmax = self._enc_nbytes(self.codec, min(self.cn, self.my_end - self.my_start))
        stream, reader = inc.stream, _Reader(inc.stream, nmax)
        try:
            take = self._store if self.robust else self._accumulate
            for ci, (a, b) in enumerate(self.my_chunks):
                if self.robust:
                    await self._slot_free(ci)
                nb = self._enc_nbytes(self.codec, b - a)
                data = await reader.read_exact(nb, self.cfg.read_timeout(nb))
                if data is None:
                    raise _Drop(f"sent less than the {nb} bytes of chunk {ci} (too little data)")
                try:
                    if not await self._compute(take, inc, ci, data):
                        raise _Drop("round deadline: still sending")
                except CompressionError as e:
                    raise _Drop(f"chunk {ci} rejected: {e}") from None
                if self.robust:
                    self.changed.set()  # _wait_senders combines the chunks that became complete
            if not await reader.at_eof(self.cfg.stall_timeout):
                raise _Drop("sent more data than its part")
            inc.state = "complete"
        except _Drop as e:
            inc.state = "failed"
            self._fail(inc.rank, f"dropped: {e}")
            stream.reset(str(e)[:200])
        except _InputRefused as e:  # not the sender's doing: our round ends (``_wait_senders``)
            inc.state = "failed"
            if self.refused is None:
                self.refused = e
            stream.reset("the owner's own values cannot be averaged")
        except (DHTError, TimeoutError) as e:
            inc.state = "failed"
            self._fail(inc.rank, f"sender failed: {e}")
            stream.reset("stalled or failed")
        finally:
            self.buffer_bytes += reader.allocated
            self.changed.set()

    async def _wait_senders(self) -> None:
        cfg = self.cfg
        t_join = self.t0 + cfg.join_timeout
        t_reduce = self.t0 + cfg.timeout * cfg.reduce_fraction
        while True:
            # cleared before the checks: a change during an await below (a combine) is not lost
            self.changed.clear()
            if self.refused is not None:
                raise self.refused
            if self.robust:
                await self._combine_ready()
            now = time.monotonic()
            missing = self.expected - self.incoming.keys() - self.rejected
            if missing and now >= t_join:
                self.rejected |= missing
                for r in missing:
                    self._fail(r, f"did not open its stream within join_timeout={cfg.join_timeout} s")
                missing = set()
            active = [i for i in self.incoming.values() if i.state == "receiving"]
            if not missing and not active:
                break
            if now >= t_reduce:
                self.rejected |= missing
                for r in missing:
                    self._fail(r, "did not open its stream before the reduce deadline")
                for inc in active:
                    inc.state = "failed"
                    self._fail(inc.rank, "round deadline: still sending")
                    inc.stream.reset("round deadline")
                break
            wake = min(t_join, t_reduce) if missing else t_reduce
            await wait_event(self.changed, max(0.0, wake - now))
        self.reduce_closed = True
        self.combined_ev.set()
        if self.robust:
            await self._combine_ready()  # the rest, with whatever arrived

    def _snapshot(self) -> dict:
        # In the worker (after every accumulate submitted before the close): a consistent view.
        nc = len(self.my_chunks)
        ok = sorted([self.rank] + [r for r, i in self.incoming.items() if i.done == nc])
        part = sorted([r, i.done] for r, i in self.incoming.items() if 0 < i.done < nc)
        return {"ok": ok, "part": part, "w": float(min(self.wsum))}

    def _wire_pair(self, codec: Codec, numel: int) -> list[torch.Tensor | None]:
        """Two wire buffers for a pipeline of ``codec`` encodes of chunks of up to ``numel`` values
        (chunk ``ci`` uses ``ci % 2``: it is written out before chunk ``ci + 2`` is encoded),
        from the service's pool and back to it after the round; None where the codec has no use."""
        if not (_base(codec).uses_out and numel):
            return [None, None]
        pair = [self.svc._take_wire(self._enc_nbytes(codec, numel)) for _ in range(2)]
        self.wires += pair
        self.buffer_bytes += sum(t.numel() for t in pair)
        return pair

    def _finalize(self, ci: int, out_wire: torch.Tensor | None = None) -> memoryview:
        if self.replies:
            wire = self.replies.pop(ci, None)
            if wire is not None:  # encoded with the chunk's last contribution (``_accumulate``)
                return memoryview(wire.numpy())
        a, b = self.my_chunks[ci]
        x = self.acc[a - self.my_start : b - self.my_start]
        out = self.flat[a:b]
        scale = 1.0
        if self.count[ci] == 1:
            x = out  # only our own contribution: keep the exact local values
            if not self.input_checked and not abs_max(out) < float("inf"):  # not read by a decode_add_base
                raise _InputRefused(self._own_error(float("nan"), a, b))
        elif self.robust:  # _combine wrote the aggregate itself, nothing to divide
            if type(self.gcodec) is NoneCodec:
                check_finite(x, "none: input chunk")
                out.copy_(x)
                return memoryview(out.numpy()).cast("B")
        elif type(self.gcodec) is NoneCodec:
            # Lossless, and finite by construction (``_accumulate`` kept |sum| <= _SUM_LIMIT; the
            # divisor wsum / w_own >= 1 once another contribution counted): divide straight into
            # flat and send that (no check pass, no separate division pass, no copy). A running
            # mean is in flat already.
            if not self.running_mean:
                torch.div(x, self.wsum[ci] / self.weight, out=out)
            return memoryview(out.numpy()).cast("B")
        else:  # the division rides on the encode (int8 rescales its block scales): no pass of its own
            scale = self.weight / self.wsum[ci]
        # hold exactly what the other members will decode (int8: in the encode's own pass)
        roundtrip = not self.gcodec.lossless and self.count[ci] > 1
        enc = self.gcodec.encode(x, out=out_wire, scale=scale, decoded=out if roundtrip else None)
        bufs = enc.buffers
        data = bufs[0] if len(bufs) == 1 else torch.cat([t if isinstance(t, torch.Tensor) else
                                                         torch.frombuffer(bytearray(t), dtype=torch.uint8) for t in bufs])
        mv = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)
        if self.gcodec.lossless and x.data_ptr() != out.data_ptr():  # (an in-place accumulator is ``out`` already)
            out.copy_(x)
        return mv

    async def _own_shard(self) -> None:
        s, e = self.my_start, self.my_end
        res = ShardResult(self.rank, s, e)
        self.own_shard = res
        await self._wait_senders()
        summary = await self._compute(self._snapshot)
        res.contributors, res.partial, res.weight = summary["ok"], dict(summary["part"]), summary["w"]
        self.t_reduce = max(self.t_reduce, time.monotonic() - self.t0)
        recips = [i for i in self.incoming.values() if i.state == "complete"]
        body = pack(summary)
        head = _PREFIX.pack(len(body)) + body
        await self._broadcast(recips, head)
        # (with replies made early, only a chunk some sender never finished is encoded here)
        wires = self._wire_pair(self.gcodec, min(self.cn, e - s)) if self.replies is None else [None, None]
        nxt: asyncio.Future | None = self._submit(self._finalize, 0, wires[0])
        done = False
        try:
            for ci, (a, b) in enumerate(self.my_chunks):
                data = await nxt
                if ci + 1 < len(self.my_chunks):
                    nxt = self._submit(self._finalize, ci + 1, wires[(ci + 1) % 2])
                else:
                    nxt = None
                res.averaged = b - s
                await self._broadcast(recips, self.svc._reply(ci, data))
            res.status = "ok"
            done = True
        except CompressionError as err:  # e.g. the average overflows fp16
            res.error = f"cannot encode the averaged shard: {err}"
        finally:
            _retrieve(nxt)
            for inc in recips:
                if done:
                    inc.stream.write_eof()
                else:
                    inc.stream.reset("owner could not finish the result")
            for inc in self.incoming.values():
                self._account(inc.stream)
                inc.finished.set()

    async def _broadcast(self, recips: list[_Incoming], data: Any) -> None:
        async def one(inc: _Incoming) -> None:
            try:
                await inc.stream.write(data, timeout=self.cfg.read_timeout(len(data)))
            except (DHTError, TimeoutError) as e:
                inc.state = "failed"
                self._fail(inc.rank, f"stopped reading the result: {e}")
                inc.stream.reset("stalled")
        if len(recips) == 1:
            await one(recips[0])
        elif recips:
            await asyncio.gather(*(one(i) for i in recips))
        recips[:] = [i for i in recips if i.state == "complete"]

    # ------------------------------------------------------------------ sender: one task per owner
    def _encode(self, a: int, b: int, out_wire: torch.Tensor | None = None) -> list[memoryview]:
        if self.raw:  # flat was checked finite by ``run``: its bytes are the message
            return [memoryview(self.flat[a:b].numpy()).cast("B")]
        return self.codec.encode(self.flat[a:b], key=("allreduce", a), out=out_wire).memoryviews()

    def _decode(self, a: int, b: int, buf: memoryview) -> None:
        if self.raw_reply and len(buf) == 4 * (b - a):
            # 16 KiB at a time, each piece checked before it is written: where the codec's decode
            # made a check pass and then a copy. A NaN/inf stops it after the pieces before it,
            # which hold the owner's finite averages like the chunks before them.
            done = kernels.copy_finite(frombuffer(buf, torch.float32, 0, b - a), self.flat[a:b], self.stream_out)
            if done < b - a:
                raise _PartialResult(done)
            return
        self.gdecoder.decode(dict(self.gmeta, numel=b - a), buf, out=self.flat[a:b])

    async def _send_part(self, j: int) -> ShardResult:
        a0, b0 = self.bounds[j]
        res = ShardResult(j, a0, b0)
        chunks = _chunks(a0, b0, self.cn)
        member = self.group.members[j]
        cfg = self.cfg
        stream: Stream | None = None
        reader: _Reader | None = None
        nxt: asyncio.Future | None = None
        try:
            assert member.addr is not None
            conn = await self.svc.host.connect(member.addr[0], member.addr[1], member.peer_id, cfg.connect_timeout)
            stream = await conn.open_stream(PROTOCOL, self.header)
            wt = cfg.stall_timeout + self.svc.accept_wait
            # raw chunks are views of flat: no encode work to overlap with the network
            submit = self._submit if not self.raw else self._inline
            wires = self._wire_pair(self.codec, min(self.cn, b0 - a0))
            nxt = submit(self._encode, *chunks[0], wires[0])
            for ci in range(len(chunks)):
                views = await nxt
                if ci + 1 < len(chunks):
                    nxt = submit(self._encode, *chunks[ci + 1], wires[(ci + 1) % 2])
                else:
                    nxt = None
                await self.svc._before_chunk(j, ci)
                views = self.svc._outgoing(j, ci, views)
                if self.ledger is not None:
                    self.ledger.sent(j, ci, views)
                for v in views:
                    await stream.write(v, timeout=max(wt, cfg.read_timeout(len(v))))
            stream.write_eof()
            self.t_reduce = max(self.t_reduce, time.monotonic() - self.t0)
            # gather: the owner replies once all of its senders are done
            reader = _Reader(stream)
            head = bytearray(_PREFIX.size)
            wait = max(cfg.stall_timeout, self.deadline - time.monotonic())
            if await reader.readinto(memoryview(head), wait) < len(head):
                raise _Drop("closed the stream without a result (it excluded us)")
            (ln,) = _PREFIX.unpack(head)
            if ln > MAX_SUMMARY:
                raise _Drop("result summary too large")
            body = bytearray(ln)
            if await reader.readinto(memoryview(body), cfg.stall_timeout) < ln:
                raise _Drop("truncated result summary")
            self._read_summary(res, body)
            reader.max_bytes = self._enc_nbytes(self.gcodec, min(self.cn, b0 - a0))
            for a, b in chunks:
                nb = self._enc_nbytes(self.gcodec, b - a)
                data = await reader.read_exact(nb, cfg.read_timeout(nb))
                if data is None:
                    raise _Drop("result ended early")
                try:
                    await self._compute(self._decode, a, b, data)
                except CompressionError as e:
                    if isinstance(e, _PartialResult):
                        res.averaged = a - a0 + e.done
                    raise _Drop(f"result rejected: {e}") from None
                res.averaged = b - a0
            if not await reader.at_eof(cfg.stall_timeout):
                raise _Drop("result longer than the shard")
            res.status = "ok"
        except CompressionError as e:  # our own input does not encode (e.g. beyond fp16 range)
            if not self.input_checked:  # a NaN/inf that ``run`` left to the encode: end the round
                raise _InputRefused(f"a chunk we were sending: {e}") from None
            res.error = f"cannot encode our part: {e}"
        except _Drop as e:
            res.error = f"owner {j} misbehaved: {e}"
            self._fail(j, res.error)
        except (DHTError, TimeoutError) as e:
            res.error = f"owner {j} failed: {e}"
            self._fail(j, res.error)
            self._gone(j)
        finally:
            _retrieve(nxt)
            if reader is not None:
                self.buffer_bytes += reader.allocated
            if stream is not None:
                if res.status != "ok":
                    stream.reset((res.error or "cancelled")[:200])
                self._account(stream)
        return res

    def _gone(self, j: int, why: str = "unreachable") -> None:
        """``j`` cannot send us its part any more: our exchange with it failed and no connection
        to it is left (it died or cannot be reached), or its last connection closed. Stop waiting
        for its part of our shard instead of sitting out ``join_timeout``."""
        if (self.is_owner and j in self.expected and j not in self.incoming and j not in self.rejected
                and self.svc.host.connection(self.group.members[j].peer_id) is None):
            self.rejected.add(j)
            self._fail(j, f"{why}: gave up waiting for its stream")
            if not self.failed[j].startswith(why):  # _fail kept (and logged) an earlier reason
                log.info("all-reduce %s: rank %d: %s: gave up waiting for its stream",
                         self.group.group_id.hex()[:8], j, why)
            self.changed.set()

    def _on_disconnect(self, peer: PeerID) -> None:
        """The last connection to ``peer`` closed. If it is a member that has not opened its
        stream to us yet, it never will: this catches the member that dies after our own
        exchange with it succeeded (or while a second connection to it still looked open)."""
        try:
            j = self.group.rank_of(peer)
        except KeyError:
            return
        self._gone(j, "connection lost")

    def _read_summary(self, res: ShardResult, body: bytearray) -> None:
        try:
            s = unpack(body)
        except ProtocolError:
            raise _Drop("malformed result summary") from None
        rng = range(self.size)
        if not (
            isinstance(s, dict) and isinstance(s.get("ok"), list) and isinstance(s.get("part"), list)
            and isinstance(s.get("w"), (int, float)) and all(isinstance(r, int) and r in rng for r in s["ok"])
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and p[0] in rng
                    and isinstance(p[1], int) for p in s["part"])
        ):
            raise _Drop("malformed result summary")
        res.contributors, res.partial, res.weight = list(s["ok"]), dict(s["part"]), float(s["w"])

    # ------------------------------------------------------------------ the round
    async def run(self) -> AllReduceResult:
        sends: list[asyncio.Task] = []
        unsubscribe = self.svc.host.on_disconnect(self._on_disconnect)
        try:
            async with asyncio.TaskGroup() as tg:
                for j, (a, b) in enumerate(self.bounds):
                    if j != self.rank and b > a:
                        sends.append(tg.create_task(self._send_part(j)))
                if self.is_owner:
                    tg.create_task(self._own_shard())
        except* _InputRefused as eg:  # (the other tasks are cancelled; the service aborts the rest)
            raise CompressionError(f"flat cannot be averaged; refusing it (found during the round, after part of "
                                   f"it went out): {eg.exceptions[0]}") from None
        finally:
            unsubscribe()
        total = time.monotonic() - self.t0
        shards = [t.result() for t in sends]
        if self.own_shard is not None:
            shards.append(self.own_shard)
        shards.sort(key=lambda s: s.owner)
        ok = [s.weight for s in shards if s.status == "ok"]
        return AllReduceResult(
            group_id=self.group.group_id, group_size=self.size,
            members=tuple(m.peer_id for m in self.group.members), rank=self.rank, shards=shards,
            failed=dict(sorted(self.failed.items())), weight_total=min(ok) if ok else self.weight,
            bytes_sent=self.bytes_sent, bytes_received=self.bytes_received, time_total=total,
            time_reduce=min(self.t_reduce, total), time_gather=max(0.0, total - self.t_reduce),
            buffer_bytes=self.buffer_bytes,
        )

    def abort(self, reason: str) -> None:
        """Reset every stream whose exchange did not finish (finished ones are left alone: the
        remote may still be reading what we wrote before our EOF)."""
        self.reduce_closed = True
        self.combined_ev.set()
        for inc in self.incoming.values():
            if not inc.finished.is_set():
                if inc.state == "receiving":
                    inc.state = "failed"
                inc.stream.reset(reason)
                inc.finished.set()
