"""The sender's side of one all-reduce round: one task per owner writes our part of its shard,
chunk by chunk (encoded in the worker thread, pipelined with the network), then reads the owner's
reply into ``flat``.

Failures: an owner that dies, resets or stalls leaves us our local values for its shard (the chunks
already received back stay averaged: ``ShardResult.averaged`` says how many values) and the shard
is reported ``failed`` with the reason. A reply that fails validation (NaN/inf, too short or long)
is dropped like a dead owner; the chunks before it stay averaged (with a ``none`` reply, also the
16 KiB pieces of the bad chunk before the first NaN/inf). Every read/write waits at most
``max(stall_timeout, 4 * frame_bytes / min_bandwidth)`` for progress.

Hot path: for ``none`` we send views of ``flat`` (``run`` checked it is finite: no encode pass),
``none`` replies are checked and copied into ``flat`` in one pass, and where ``flat`` outgrows the
last-level cache replies are written around it (streaming stores: no read before write).

A ``flat`` on a device (``ctx.staged``): chunks are encoded on the device and replies decoded onto it
by the codecs' device paths, so only wire bytes cross between the device and the host.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable

import torch

from dht import DHTError, Stream

from ..compression import CompressionError, ErrorFeedback, kernels
from ..compression.base import frombuffer
from .context import RoundContext, retrieve
from .ledger import chunks as _chunks
from .protocol import MAX_SUMMARY, PREFIX, PROTOCOL, Reader, parse_summary
from .round_types import Drop, InputRefused, PartialResult, ShardResult

__all__ = ["Sender"]


def _no_gone(j: int) -> None:
    pass


class Sender:
    """Our part of every other owner's shard in round ``ctx``. ``gone(j)``: our exchange with owner
    ``j`` failed (the owner side may stop waiting for ``j``'s part of our shard)."""

    def __init__(self, ctx: RoundContext, gone: Callable[[int], None] = _no_gone):
        self.ctx = ctx
        self.gone = gone
        codec, gcodec = ctx.codec, ctx.gcodec
        dev = ctx.flat.device.type
        self.staged = ctx.staged
        self.enc_staged = self.staged and dev in codec.devices  # (else ``encode``: error feedback)
        self.dec_staged = self.staged and dev in gcodec.devices
        # ``none`` on float32 (no error feedback): a chunk's wire bytes are its values, and ``run``
        # checked ``flat`` is finite, so we send views of it (no encode pass, no worker hop)
        self.raw = codec.wire_is_values and not self.staged
        # ``none`` replies: checked and copied into ``flat`` in one pass (see ``_decode``)
        self.raw_reply = gcodec.wire_is_values and kernels.AVAILABLE and not self.staged
        # Replies go into ``flat`` and nothing in the round reads them again: where ``flat`` outgrows
        # the last-level cache they are written around it (streaming stores: no read before write).
        self.stream_out = kernels.stream_worthwhile(ctx.flat.numel() * ctx.flat.element_size())
        self.gdecoder = gcodec
        if self.stream_out and not isinstance(gcodec, ErrorFeedback):
            self.gdecoder = copy.copy(gcodec)
            self.gdecoder.stream_decoded = True

    def _encode(self, a: int, b: int, out_wire: torch.Tensor | None = None) -> list[memoryview]:
        flat = self.ctx.flat
        if self.raw:  # flat was checked finite by ``run``: its bytes are the message
            return [memoryview(flat[a:b].numpy()).cast("B")]
        if self.enc_staged:
            return self.ctx.codec.device_encode(flat[a:b], out=out_wire).memoryviews()
        return self.ctx.codec.encode(flat[a:b], key=("allreduce", a), out=out_wire).memoryviews()

    def _decode(self, a: int, b: int, buf: memoryview) -> None:
        flat = self.ctx.flat
        if self.raw_reply and len(buf) == 4 * (b - a):
            # 16 KiB at a time, each piece checked before it is written: where the codec's decode
            # made a check pass and then a copy. A NaN/inf stops it after the pieces before it,
            # which hold the owner's finite averages like the chunks before them.
            done = kernels.copy_finite(frombuffer(buf, torch.float32, 0, b - a), flat[a:b], self.stream_out)
            if done < b - a:
                raise PartialResult(done)
            return
        if self.dec_staged:
            self.gdecoder.device_decode(dict(self.ctx.gmeta, numel=b - a), buf, flat[a:b])
        else:
            self.gdecoder.decode(dict(self.ctx.gmeta, numel=b - a), buf, out=flat[a:b])

    async def send_part(self, j: int) -> ShardResult:
        """Send our part of owner ``j``'s shard and take its reply."""
        ctx, res_ = self.ctx, self.ctx.res
        a0, b0 = ctx.bounds[j]
        res = ShardResult(j, a0, b0)
        chunks = _chunks(a0, b0, ctx.cn)
        member = ctx.group.members[j]
        cfg = ctx.cfg
        stream: Stream | None = None
        reader: Reader | None = None
        nxt: asyncio.Future | None = None
        try:
            conn = await member.reach.dial(res_.host, member.peer_id, cfg.connect_timeout)
            stream = await conn.open_stream(PROTOCOL, ctx.header)
            wt = cfg.stall_timeout + res_.accept_wait
            # raw chunks are views of flat: no encode work to overlap with the network
            submit = ctx.submit if not self.raw else ctx.inline
            wires = ctx.wire_pair(ctx.codec, min(ctx.cn, b0 - a0))
            nxt = submit(self._encode, *chunks[0], wires[0])
            for ci in range(len(chunks)):
                views = await nxt
                if ci + 1 < len(chunks):
                    nxt = submit(self._encode, *chunks[ci + 1], wires[(ci + 1) % 2])
                else:
                    nxt = None
                await res_.before_chunk(j, ci)
                views = res_.outgoing(j, ci, views)
                if ctx.ledger is not None:
                    ctx.ledger.sent(j, ci, views)
                for v in views:
                    await stream.write(v, timeout=max(wt, cfg.read_timeout(len(v))))
            stream.write_eof()
            ctx.t_reduce = max(ctx.t_reduce, time.monotonic() - ctx.t0)
            # gather: the owner replies once all of its senders are done
            reader = Reader(stream)
            head = bytearray(PREFIX.size)
            wait = max(cfg.stall_timeout, ctx.deadline - time.monotonic())
            if await reader.readinto(memoryview(head), wait) < len(head):
                raise Drop("closed the stream without a result (it excluded us)")
            (ln,) = PREFIX.unpack(head)
            if ln > MAX_SUMMARY:
                raise Drop("result summary too large")
            body = bytearray(ln)
            if await reader.readinto(memoryview(body), cfg.stall_timeout) < ln:
                raise Drop("truncated result summary")
            res.contributors, res.partial, res.weight, res.weights = parse_summary(body, ctx.size)
            reader.max_bytes = ctx.enc_nbytes(ctx.gcodec, min(ctx.cn, b0 - a0))
            for a, b in chunks:
                nb = ctx.enc_nbytes(ctx.gcodec, b - a)
                data = await reader.read_exact(nb, cfg.read_timeout(nb))
                if data is None:
                    raise Drop("result ended early")
                try:
                    await ctx.compute(self._decode, a, b, data)
                except CompressionError as e:
                    if isinstance(e, PartialResult):
                        res.averaged = a - a0 + e.done
                    raise Drop(f"result rejected: {e}") from None
                res.averaged = b - a0
            if not await reader.at_eof(cfg.stall_timeout):
                raise Drop("result longer than the shard")
            res.status = "ok"
        except CompressionError as e:  # our own input does not encode (e.g. beyond fp16 range)
            if not ctx.input_checked:  # a NaN/inf that ``run`` left to the encode: end the round
                raise InputRefused(f"a chunk we were sending: {e}") from None
            res.error = f"cannot encode our part: {e}"
        except Drop as e:
            res.error = f"owner {j} misbehaved: {e}"
            ctx.fail(j, res.error)
        except (DHTError, TimeoutError) as e:
            res.error = f"owner {j} failed: {e}"
            ctx.fail(j, res.error)
            self.gone(j)
        finally:
            retrieve(nxt)
            if reader is not None:
                ctx.buffer_bytes += reader.allocated
            if stream is not None:
                if res.status != "ok":
                    stream.reset((res.error or "cancelled")[:200])
                ctx.account(stream)
        return res
