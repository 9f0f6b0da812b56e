"""An owner's reduction of its shard, sans-IO: the contributions of the senders are accumulated (or,
under a robust rule, stored and combined) chunk by chunk, and each chunk is finalized into the
reply the others decode. No asyncio: the round runs these calls in its worker thread (FIFO, so
accumulation and finalization are strictly ordered without locks) or inline.

The accumulator is filled lazily chunk by chunk, from our own values at the first foreign
contribution; a chunk nobody else contributed to keeps its exact local values. A sender that dies
half-way contributes exactly the chunks it completed: chunk c averages to ``acc_c / wsum_c``. The
owner's own part enters with its own weight (exactly, never through the codec).

Own values: where ``run`` did not read the input up front (``absmax`` None: a codec whose encode
refuses NaN/inf in the pass that reads each chunk), our own shard is checked where the round first
reads each of its chunks: the first contribution's ``decode_add_base``, which measures max |own| in
the pass that adds to it (or, for a chunk nobody contributed to, a check before its reply is
encoded). Until then a chunk's own values count as half the sum's limit.

How the shard is summed is chosen once per round by :func:`choose_strategy` (see :class:`Strategy`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compression import Codec, CompressionError
from ..compression.base import abs_max, check_finite, frombuffer
from .robust import aggregate
from .round_types import InputRefused, base_codec

__all__ = ["ROBUST_WINDOW", "SUM_LIMIT", "ShardReducer", "Strategy", "choose_strategy"]

#: robust aggregation: chunks a sender may have buffered at the owner ahead of the last combined one
ROBUST_WINDOW = 2

#: the largest |sum| an owner's float32 accumulator may reach: half of float32's max leaves room
#: for the rounding of every addition, so a sum checked against it never overflows to inf
SUM_LIMIT = float(torch.finfo(torch.float32).max) / 2


@dataclass(frozen=True)
class Strategy:
    """How an owner sums its shard (one round, chosen by :func:`choose_strategy`)."""

    robust: bool  # rows stored per sender and combined by a robust rule (no streaming sum)
    #: sum in our own shard of ``flat`` (no second shard-sized buffer, a third less memory traffic):
    #: every payload is checked before it is added and the reply's encode cannot fail on a finite sum
    in_place: bool
    #: ``none`` both ways: a running weighted mean in ``flat`` (one lerp per contribution, no division)
    running_mean: bool
    #: the contribution that completes a chunk is added and the reply encoded in one pass (int8 with
    #: the kernels), the reply kept in a buffer of a quarter of the shard until the replies go out
    fused_reply: bool


def choose_strategy(codec: Codec, gcodec: Codec, aggregation: str, absmax: float | None) -> Strategy:
    """The summing strategy for a round that sends with ``codec``, replies with ``gcodec`` under
    ``aggregation``, our own values bounded by ``absmax`` (None: not measured up front)."""
    robust = aggregation != "mean"
    # Robust rules need our own row at combine time, and a reply that may fail to encode (fp16/bf16)
    # needs flat[s:e] untouched until the division.
    in_place = not robust and base_codec(gcodec).encode_total
    # A lerp of two values within SUM_LIMIT cannot overflow; own values beyond it (never, in
    # practice) keep the sum-then-divide path.
    running_mean = (in_place and codec.wire_is_values and gcodec.wire_is_values and absmax is not None
                    and absmax <= SUM_LIMIT)
    fused = in_place and base_codec(codec).fuses_add_encode(gcodec)
    return Strategy(robust=robust, in_place=in_place, running_mean=running_mean, fused_reply=fused)


def own_error(own: float, a: int, b: int, grow: float = 0.0) -> str:
    where = f"flat[{a}:{b}] (in our own shard)"
    if not own < float("inf"):
        return f"{where} contains NaN or inf"
    return (f"{where} holds values up to {own:.3g}, which the group's float32 sum could overflow (with "
            f"a contribution of up to {grow:.3g})")


class ShardReducer:
    """The reduction of our shard ``flat[start:end]`` (split in ``chunks``, in absolute indices) in a
    group of ``size``, our own weight ``weight``; ``n_expected`` senders may contribute. ``own``
    holds the shard's values on the CPU (a view of ``flat``, or a host copy of a device ``flat``'s
    shard, then ``dest``: each finalized chunk is written back there). ``take_scratch`` and
    ``take_wire`` lend kept buffers (``wires`` and ``acc`` go back to the lender after the round)."""

    def __init__(self, own: torch.Tensor, dest: torch.Tensor | None, rank: int, size: int, start: int, end: int,
                 chunks: list[tuple[int, int]], chunk_numel: int, weight: float, codec: Codec, gcodec: Codec,
                 rmeta: dict, aggregation: str, absmax: float | None, strategy: Strategy, n_expected: int,
                 take_scratch: Callable[[int], torch.Tensor], take_wire: Callable[[int], torch.Tensor]):
        self.own, self.dest, self.rank, self.size, self.start, self.chunks = own, dest, rank, size, start, chunks
        self.weight, self.codec, self.gcodec, self.rmeta, self.agg = weight, codec, gcodec, rmeta, aggregation
        self.input_checked = absmax is not None
        self.strategy = strategy
        self.robust, self.in_place, self.running_mean = strategy.robust, strategy.in_place, strategy.running_mean
        self.n_expected = n_expected
        self.wires: list[torch.Tensor] = []
        self.buffer_bytes = 0
        self.replies: dict[int, torch.Tensor] | None = None  # fused_reply: replies made early
        numel, nc = end - start, len(chunks)
        if self.in_place:
            self.acc = own
        else:
            self.acc = take_scratch(numel)
            self.buffer_bytes += numel * 4
        self.wsum = [float(weight)] * nc
        self.count = [1] * nc
        if self.robust:
            # ROBUST_WINDOW slots of [group size, chunk] decoded float32 values (a sender may store
            # chunk c only once chunk c - ROBUST_WINDOW is combined): the bound is ROBUST_WINDOW *
            # size * chunk_numel * 4 bytes, whatever the shard size. Row ``rank`` of a slot takes
            # our own values at combine time.
            self.slots = torch.empty(ROBUST_WINDOW, size, min(chunk_numel, numel), dtype=torch.float32)
            self.buffer_bytes += self.slots.numel() * 4
        else:
            # Per chunk, a bound on |sum| of what the accumulator holds (own values at ratio 1 to
            # start): a contribution that could push it past SUM_LIMIT is refused before it is
            # added, so the sum never overflows, a hostile sender's finite but huge values cannot
            # make our shard fail (or, summed in place, turn our own values into inf), and the
            # division needs no finiteness pass. The checks already done (add_bound) make the
            # decoder's own finiteness pass redundant: ``adder`` skips it.
            self.bound = [SUM_LIMIT / 2 if absmax is None else float(absmax)] * nc
            self.adder = copy.copy(base_codec(codec))
            self.adder.check_finite_on_decode = False
            if strategy.fused_reply:
                self.replies = {}
                self.reply_stride = gcodec.encoded_nbytes(min(chunk_numel, numel))  # (one full chunk's)
                self.reply_wire = take_wire(self.reply_stride * nc)
                self.wires.append(self.reply_wire)
                self.buffer_bytes += self.reply_wire.numel()

    def accumulate(self, weight: float, ci: int, buf: memoryview) -> None:
        """Add a sender's chunk ``ci`` (wire bytes ``buf``) at ``weight``. Raises CompressionError
        (the sender's fault: nothing was added) or InputRefused (our own values cannot be averaged)."""
        a, b = self.chunks[ci]
        acc = self.acc[a - self.start : b - self.start]
        # acc holds sum_i (w_i / w_own) * x_i with our own values at ratio 1 (``finalize`` divides
        # by wsum / w_own): starting it from our own values then needs no multiply pass. The first
        # foreign contribution writes acc = own + ratio * theirs in one pass; a message that fails
        # validation leaves acc untouched and never counts (a chunk still at count 1 keeps flat).
        # With ``running_mean``, acc holds the weighted mean itself.
        meta = dict(self.rmeta, numel=b - a)
        if self.running_mean:
            top = self.codec.add_bound(meta, buf)  # validates: NaN/inf and malformed raise
            if not top <= SUM_LIMIT:
                raise CompressionError(f"values up to {top:.3g} would overflow the float32 mean")
            wsum = self.wsum[ci] + weight
            torch.lerp(acc, frombuffer(buf, torch.float32, 0, b - a), weight / wsum, out=acc)
            self.wsum[ci] = wsum
            self.count[ci] += 1
            return
        ratio = weight / self.weight
        grow = self.codec.add_bound(meta, buf) * ratio  # validates: NaN/inf and malformed raise
        if not self.bound[ci] + grow <= SUM_LIMIT:
            raise CompressionError(f"values up to {grow / ratio:.3g} at weight {weight:.3g} would overflow "
                                   f"the float32 sum")
        last = self.replies is not None and self.count[ci] == self.n_expected
        measure = self.count[ci] == 1 and not self.input_checked  # our own values, read in this pass
        if last:  # the chunk's last contribution: the sum and the reply's encoding in one pass
            wire, own = self.adder.decode_add_encode(meta, buf, acc, ratio, self.weight / (self.wsum[ci] + weight),
                                                     self.reply_wire[ci * self.reply_stride :
                                                                     (ci + 1) * self.reply_stride])
        elif measure:
            own = self.adder.decode_add_base(meta, buf, acc, ratio, self.own[a - self.start : b - self.start])
        else:
            base = self.own[a - self.start : b - self.start] if self.count[ci] == 1 else None
            self.adder.decode_add(meta, buf, acc, ratio, base=base)
        if measure:
            if not own + grow <= SUM_LIMIT:  # (NaN compares false)
                raise InputRefused(own_error(own, a, b, grow))
            self.bound[ci] = own + grow
        else:
            self.bound[ci] += grow
        if last:
            if wire is None:  # (cannot happen: the bound keeps the sum finite)
                raise CompressionError(f"the average of flat[{a}:{b}] does not encode")
            assert self.replies is not None
            self.replies[ci] = wire
        self.wsum[ci] += weight
        self.count[ci] += 1

    def store(self, rank: int, ci: int, buf: memoryview) -> None:
        """Robust counterpart of ``accumulate``: decode sender ``rank``'s chunk ``ci`` into its row
        of the chunk's slot, for ``combine``. Raises CompressionError."""
        a, b = self.chunks[ci]
        row = self.slots[ci % ROBUST_WINDOW, rank, : b - a]
        base_codec(self.codec).decode(dict(self.rmeta, numel=b - a), buf, out=row)
        check_finite(row, "received chunk")  # whatever the codec's own option: NaN/inf never enter

    def combine(self, ci: int, senders: list[tuple[int, float]]
                ) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """Combine chunk ``ci`` from the stored rows of ``senders`` (rank, counted weight) and our
        own values; returns (ranks, rows, weights) as combined, or None with no sender."""
        if not senders:
            return None  # only our own values: count stays 1, finalize keeps them exactly
        a, b = self.chunks[ci]
        slot = self.slots[ci % ROBUST_WINDOW, :, : b - a]
        slot[self.rank].copy_(self.own[a - self.start : b - self.start])
        weights = dict(senders)
        rows = sorted(list(weights) + [self.rank])
        x = slot if len(rows) == self.size else slot[rows]
        w = torch.tensor([self.weight if r == self.rank else weights[r] for r in rows], dtype=torch.float32)
        aggregate(self.agg, x, w, out=self.acc[a - self.start : b - self.start])
        self.wsum[ci] = float(w.sum())
        self.count[ci] = len(rows)
        return rows, x, w

    def finalize(self, ci: int, out_wire: torch.Tensor | None = None) -> memoryview:
        """Chunk ``ci``'s reply (wire bytes in the gather codec); our own ``flat`` then holds exactly
        what the others decode. Raises CompressionError (the average does not encode) or InputRefused."""
        reply = self._reply(ci, out_wire)
        if self.dest is not None and self.count[ci] > 1:  # (a chunk of only our values is there already)
            a, b = self.chunks[ci][0] - self.start, self.chunks[ci][1] - self.start
            self.dest[a:b].copy_(self.own[a:b])
        return reply

    def _reply(self, ci: int, out_wire: torch.Tensor | None) -> memoryview:
        """``finalize``'s reply, the final values in ``own``."""
        if self.replies:
            wire = self.replies.pop(ci, None)
            if wire is not None:  # encoded with the chunk's last contribution (``accumulate``)
                return memoryview(wire.numpy())
        a, b = self.chunks[ci]
        x = self.acc[a - self.start : b - self.start]
        out = self.own[a - self.start : b - self.start]
        scale = 1.0
        if self.count[ci] == 1:
            x = out  # only our own contribution: keep the exact local values
            if not self.input_checked and not abs_max(out) < float("inf"):  # not read by a decode_add_base
                raise InputRefused(own_error(float("nan"), a, b))
        elif self.robust:  # combine wrote the aggregate itself, nothing to divide
            if self.gcodec.wire_is_values:
                check_finite(x, "none: input chunk")
                out.copy_(x)
                return memoryview(out.numpy()).cast("B")
        elif self.gcodec.wire_is_values:
            # Lossless, and finite by construction (``accumulate`` kept |sum| <= SUM_LIMIT; the
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
                                                         torch.frombuffer(bytearray(t), dtype=torch.uint8)
                                                         for t in bufs])
        mv = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)
        if self.gcodec.lossless and x.data_ptr() != out.data_ptr():  # (an in-place accumulator is ``out`` already)
            out.copy_(x)
        return mv

    def min_weight(self) -> float:
        """The smallest per-chunk weight sum behind our shard's values."""
        return float(min(self.wsum))
