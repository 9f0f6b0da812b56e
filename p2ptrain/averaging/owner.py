"""The owner's side of one all-reduce round: a task per incoming sender reads its chunks and hands
them to the :class:`~.reducer.ShardReducer` (in the worker thread), then, once every expected sender
has finished, failed or missed its deadline, the owner finalizes each chunk once and writes it to
every sender whose part arrived complete.

Robust aggregation (``aggregation`` other than ``mean``, :mod:`.robust`): each sender's chunk is
decoded into its row of a slot and, once every expected sender delivered chunk c (or failed, or
was given up on), the rows (ours included) are combined in the worker, in chunk order. A sender
may store chunk c only after chunk c - ROBUST_WINDOW is combined (else its stream waits), which
bounds the buffers beside the accumulator. Weights are capped (:func:`.group.weight_cap`).

Failures: a sender that dies or stalls is averaged over what arrived (per chunk) and gets no
reply. A hostile sender (malformed header, bad weight, numel or codec mismatch, a chunk that fails
to decode or could overflow the sum, too little or too much data, not a member, duplicate stream)
is dropped: chunks it sent before the violation stay in the average (each was validated), nothing
after; it gets no reply and is listed in ``failed``. Owners stop waiting for senders that have
not opened their stream after ``join_timeout`` and for any sender at ``reduce_fraction * timeout``.

A ``flat`` on a device: our shard is copied to the host once, reduced there as on the CPU, and
each finalized chunk written back to the device.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dht import DHTError, Stream, wait_event

from ..compression import CompressionError
from ..compression.device import host_buffer
from .context import RoundContext, log, retrieve
from .group import counted_weight, weight_cap
from .protocol import Reader, check_header, pack_summary
from .reducer import ROBUST_WINDOW, ShardReducer, choose_strategy
from .round_types import Drop, InputRefused, ShardResult

__all__ = ["Owner"]


@dataclass(eq=False)
class _Incoming:
    rank: int
    stream: Stream
    weight: float
    done: int = 0  # chunks accumulated (always a prefix)
    state: str = "receiving"  # "complete" | "failed"
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set when the reply is written


class Owner:
    """Our shard's side of round ``ctx`` (a member that owns a non-empty shard)."""

    def __init__(self, ctx: RoundContext, absmax: float | None):
        self.ctx = ctx
        s, e = ctx.my_start, ctx.my_end
        self.expected = {r for r in range(ctx.size) if r != ctx.rank}
        self.incoming: dict[int, _Incoming] = {}
        self.rejected: set[int] = set()  # senders whose stream we no longer accept
        self.refused: InputRefused | None = None  # our own shard failed its check
        self.changed = asyncio.Event()
        self.reduce_closed = False
        self.strategy = choose_strategy(ctx.codec, ctx.gcodec, ctx.agg, absmax)
        own, dest = ctx.flat[s:e], None
        if ctx.staged:  # a device flat: our shard is reduced in a host copy, written back chunk by chunk
            own, dest = host_buffer(4 * (e - s)).view(torch.float32).copy_(own), own
            ctx.buffer_bytes += 4 * (e - s)
        self.reducer = ShardReducer(
            own, dest, ctx.rank, ctx.size, s, e, ctx.my_chunks, ctx.cn, ctx.weight, ctx.codec, ctx.gcodec,
            ctx.rmeta, ctx.agg, absmax, self.strategy, len(self.expected), ctx.res.take_scratch, ctx.take_wire)
        ctx.buffer_bytes += self.reducer.buffer_bytes
        ctx.wires += self.reducer.wires
        self.combined = 0  # robust: chunks of our shard combined so far (a prefix)
        self.combined_ev = asyncio.Event()  # set when ``combined`` grows or the reduce closes
        self.result: ShardResult | None = None
        self.wcap = weight_cap(ctx.group.members, ctx.weight)  # the most a sender's weight counts for

    # ------------------------------------------------------------------ one task per sender
    async def serve(self, stream: Stream, rank: int) -> None:
        ctx = self.ctx
        if rank in self.incoming or rank in self.rejected or self.reduce_closed:
            stream.reset("duplicate or late stream")
            return
        bad = check_header(stream.header, rank, ctx.header, ctx.cfg.max_weight)
        if bad:
            self.rejected.add(rank)
            ctx.fail(rank, f"dropped: {bad}")
            stream.reset(bad)
            self.changed.set()
            return
        inc = _Incoming(rank, stream, counted_weight(ctx.group.members[rank], float(stream.header["w"]), self.wcap))
        self.incoming[rank] = inc
        try:
            await self._receive(inc)
            await inc.finished.wait()  # the owner writes the reply, then sets this
        finally:
            if inc.state == "receiving":
                inc.state = "failed"
                ctx.fail(rank, "connection closed while sending")
            self.changed.set()
            inc.finished.set()

    def _accumulate(self, inc: _Incoming, ci: int, buf: memoryview) -> bool:
        # Worker thread (or inline): add + bookkeeping are one step, ordered before the division,
        # which is submitted to the same single thread after ``reduce_closed`` is set.
        if self.reduce_closed or inc.state != "receiving":
            return False
        self.reducer.accumulate(inc.weight, ci, buf)
        inc.done = ci + 1
        return True

    def _store(self, inc: _Incoming, ci: int, buf: memoryview) -> bool:
        # Robust counterpart of _accumulate: combined later by _combine.
        if self.reduce_closed or inc.state != "receiving":
            return False
        self.reducer.store(inc.rank, ci, buf)
        inc.done = ci + 1
        return True

    async def _receive(self, inc: _Incoming) -> None:
        ctx = self.ctx
        robust = self.strategy.robust
        nmax = ctx.enc_nbytes(ctx.codec, min(ctx.cn, ctx.my_end - ctx.my_start))
        stream, reader = inc.stream, Reader(inc.stream, nmax)
        try:
            take = self._store if robust else self._accumulate
            for ci, (a, b) in enumerate(ctx.my_chunks):
                if robust:
                    await self._slot_free(ci)
                nb = ctx.enc_nbytes(ctx.codec, b - a)
                data = await reader.read_exact(nb, ctx.cfg.read_timeout(nb))
                if data is None:
                    raise Drop(f"sent less than the {nb} bytes of chunk {ci} (too little data)")
                try:
                    if not await ctx.compute(take, inc, ci, data):
                        raise Drop("round deadline: still sending")
                except CompressionError as e:
                    raise Drop(f"chunk {ci} rejected: {e}") from None
                if robust:
                    self.changed.set()  # _wait_senders combines the chunks that became complete
            if not await reader.at_eof(ctx.cfg.stall_timeout):
                raise Drop("sent more data than its part")
            inc.state = "complete"
        except Drop as e:
            inc.state = "failed"
            ctx.fail(inc.rank, f"dropped: {e}")
            stream.reset(str(e)[:200])
        except InputRefused as e:  # not the sender's doing: our round ends (``_wait_senders``)
            inc.state = "failed"
            if self.refused is None:
                self.refused = e
            stream.reset("the owner's own values cannot be averaged")
        except (DHTError, TimeoutError) as e:
            inc.state = "failed"
            ctx.fail(inc.rank, f"sender failed: {e}")
            stream.reset("stalled or failed")
        finally:
            ctx.buffer_bytes += reader.allocated
            self.changed.set()

    # ------------------------------------------------------------------ robust aggregation
    def _chunk_ready(self, ci: int) -> bool:
        """Every expected sender has delivered chunk ``ci``, or will never deliver it."""
        if self.expected - self.incoming.keys() - self.rejected:
            return False
        return all(i.state != "receiving" or i.done > ci for i in list(self.incoming.values()))

    def _combine(self, ci: int) -> None:
        # Worker thread (after every store submitted before it) or inline.
        senders = sorted((i.rank, i.weight) for i in list(self.incoming.values()) if i.done > ci)
        combined = self.reducer.combine(ci, senders)
        if combined is not None and self.ctx.ledger is not None:
            self.ctx.ledger.combined(ci, *combined)

    async def _combine_ready(self) -> None:
        """Combine, in order, every chunk all senders are done with (all of them once the reduce
        closed), freeing slots for the senders waiting in ``_slot_free``."""
        while self.combined < len(self.ctx.my_chunks) and (self.reduce_closed or self._chunk_ready(self.combined)):
            await self.ctx.compute(self._combine, self.combined)
            self.combined += 1
            self.combined_ev.set()

    async def _slot_free(self, ci: int) -> None:
        """Wait until chunk ``ci``'s slot is free (chunk ``ci - ROBUST_WINDOW`` combined)."""
        while self.combined <= ci - ROBUST_WINDOW and not self.reduce_closed:
            self.combined_ev.clear()
            if not await wait_event(self.combined_ev, max(0.0, self.ctx.deadline - time.monotonic())):
                raise Drop("round deadline: still sending")

    # ------------------------------------------------------------------ closing the reduce
    async def _wait_senders(self) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        t_join = ctx.t0 + cfg.join_timeout
        t_reduce = ctx.t0 + cfg.timeout * cfg.reduce_fraction
        while True:
            # cleared before the checks: a change during an await below (a combine) is not lost
            self.changed.clear()
            if self.refused is not None:
                raise self.refused
            if self.strategy.robust:
                await self._combine_ready()
            now = time.monotonic()
            missing = self.expected - self.incoming.keys() - self.rejected
            if missing and now >= t_join:
                self.rejected |= missing
                for r in missing:
                    ctx.fail(r, f"did not open its stream within join_timeout={cfg.join_timeout} s")
                missing = set()
            active = [i for i in self.incoming.values() if i.state == "receiving"]
            if not missing and not active:
                break
            if now >= t_reduce:
                self.rejected |= missing
                for r in missing:
                    ctx.fail(r, "did not open its stream before the reduce deadline")
                for inc in active:
                    inc.state = "failed"
                    ctx.fail(inc.rank, "round deadline: still sending")
                    inc.stream.reset("round deadline")
                break
            wake = min(t_join, t_reduce) if missing else t_reduce
            await wait_event(self.changed, max(0.0, wake - now))
        self.reduce_closed = True
        self.combined_ev.set()
        if self.strategy.robust:
            await self._combine_ready()  # the rest, with whatever arrived

    def _snapshot(self) -> dict:
        # In the worker (after every accumulate submitted before the close): a consistent view.
        nc = len(self.ctx.my_chunks)
        ok = sorted([self.ctx.rank] + [r for r, i in self.incoming.items() if i.done == nc])
        part = sorted([r, i.done] for r, i in self.incoming.items() if 0 < i.done < nc)
        # (the weight each contributor's part counted with: a round begun early declared more)
        counted = [[r, self.ctx.weight if r == self.ctx.rank else self.incoming[r].weight] for r in ok]
        return {"ok": ok, "part": part, "w": self.reducer.min_weight(), "cw": counted}

    # ------------------------------------------------------------------ the replies
    async def run(self) -> None:
        """Our shard's part of the round: wait for the senders, then write the replies."""
        ctx = self.ctx
        s, e = ctx.my_start, ctx.my_end
        res = ShardResult(ctx.rank, s, e)
        self.result = res
        await self._wait_senders()
        summary = await ctx.compute(self._snapshot)
        res.contributors, res.partial, res.weight = summary["ok"], dict(summary["part"]), summary["w"]
        res.weights = dict(summary["cw"])
        ctx.t_reduce = max(ctx.t_reduce, time.monotonic() - ctx.t0)
        recips = [i for i in self.incoming.values() if i.state == "complete"]
        await self._broadcast(recips, pack_summary(summary))
        # (with replies made early, only a chunk some sender never finished is encoded here)
        reducer = self.reducer
        wires = ctx.wire_pair(ctx.gcodec, min(ctx.cn, e - s)) if reducer.replies is None else [None, None]
        nxt: asyncio.Future | None = ctx.submit(reducer.finalize, 0, wires[0])
        done = False
        try:
            for ci, (a, b) in enumerate(ctx.my_chunks):
                data = await nxt
                if ci + 1 < len(ctx.my_chunks):
                    nxt = ctx.submit(reducer.finalize, ci + 1, wires[(ci + 1) % 2])
                else:
                    nxt = None
                res.averaged = b - s
                await self._broadcast(recips, ctx.res.reply(ci, data))
            res.status = "ok"
            done = True
        except CompressionError as err:  # e.g. the average overflows fp16
            res.error = f"cannot encode the averaged shard: {err}"
        finally:
            retrieve(nxt)
            for inc in recips:
                if done:
                    inc.stream.write_eof()
                else:
                    inc.stream.reset("owner could not finish the result")
            for inc in self.incoming.values():
                ctx.account(inc.stream)
                inc.finished.set()

    async def _broadcast(self, recips: list[_Incoming], data: Any) -> None:
        async def one(inc: _Incoming) -> None:
            try:
                await inc.stream.write(data, timeout=self.ctx.cfg.read_timeout(len(data)))
            except (DHTError, TimeoutError) as e:
                inc.state = "failed"
                self.ctx.fail(inc.rank, f"stopped reading the result: {e}")
                inc.stream.reset("stalled")
        if len(recips) == 1:
            await one(recips[0])
        elif recips:
            await asyncio.gather(*(one(i) for i in recips))
        recips[:] = [i for i in recips if i.state == "complete"]

    # ------------------------------------------------------------------ lifecycle
    def gone(self, j: int, why: str = "unreachable") -> None:
        """``j`` cannot send us its part any more: our exchange with it failed and no connection
        to it is left (it died or cannot be reached), or its last connection closed. Stop waiting
        for its part of our shard instead of sitting out ``join_timeout``."""
        ctx = self.ctx
        if (j in self.expected and j not in self.incoming and j not in self.rejected
                and ctx.res.host.connection(ctx.group.members[j].peer_id) is None):
            self.rejected.add(j)
            ctx.fail(j, f"{why}: gave up waiting for its stream")
            if not ctx.failed[j].startswith(why):  # fail kept (and logged) an earlier reason
                log.info("all-reduce %s: rank %d: %s: gave up waiting for its stream",
                         ctx.group.group_id.hex()[:8], j, why)
            self.changed.set()

    def left(self, j: int) -> None:
        """``j`` said it left the round before sending anything (``AllReduceService.leave``): stop
        waiting for its part of our shard."""
        if j in self.expected and j not in self.incoming and j not in self.rejected:
            self.rejected.add(j)
            self.ctx.fail(j, "left the round before sending its part")
            self.changed.set()

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
