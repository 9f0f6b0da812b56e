"""One round of the fault-tolerant, compressed, pipelined butterfly all-reduce (reduce-scatter +
all-gather) among the members of an already-formed :class:`~p2ptrain.averaging.group.Group`:
``Round`` is one member's part in one round, its lifecycle (``run``, ``abort``). :mod:`.allreduce`
runs rounds: its ``AllReduceService`` owns the stream handler, the registry of rounds, the worker
thread and the buffers kept between rounds, and lends them to each round (``RoundResources``).

Every member owns the shard ``partition(numel, members)[rank]`` of the flat float32 vector (sized by
declared bandwidth; client-mode members own nothing). The parts, each in its own module:

* :mod:`.protocol`: the wire (``p2ptrain/allreduce/1``: header, result summary, exact reads);
* :mod:`.sender`: one task per other owner: our part of its shard out, its average back;
* :mod:`.owner`: one task per sender into our shard, then the replies;
* :mod:`.reducer`: the sans-IO sum (or robust combination) of our shard, chunk by chunk;
* :mod:`.round_types`: configuration, results, the resources the service lends.

Our own input holding NaN/inf: ``run`` refuses it before anything is sent, except with a codec
whose encode refuses NaN/inf in the pass that reads each chunk (``int8``), where it ends the round
when found (CompressionError): to the others we are a member that died mid-round, and ``flat`` is
left as a cancelled round leaves it. The whole run is capped at ``timeout``.

Streams can arrive before the local round for that group is registered (members learn of the group
at slightly different times): the service's handler waits up to ``accept_wait`` seconds for it.

Concurrency: one event loop; a task per outgoing part and per incoming sender; codec work on large
rounds goes to ONE worker thread (torch releases the GIL), which also makes accumulation and the
final division strictly ordered (FIFO) without locks; on a process with fewer than
``offload_min_cpus`` CPUs it runs inline on the loop instead (no core to overlap with).
"""

from __future__ import annotations

import asyncio
import time

import torch

from dht import PeerID, Stream

from ..compression import Codec, CompressionError
from .context import RoundContext
from .group import Group, declared_weights
from .owner import Owner
from .round_types import AllReduceConfig, AllReduceResult, InputRefused, RoundResources, ShardResult
from .sender import Sender

__all__ = ["Round"]


class Round:
    """One member's part in one round: ``ctx`` (what both sides share), our ``owner`` side (None
    with an empty shard) and our ``sender`` side."""

    def __init__(self, res: RoundResources, group: Group, rank: int, flat: torch.Tensor, weight: float,
                 codec: Codec, gcodec: Codec, cfg: AllReduceConfig, aggregation: str = "mean",
                 absmax: float | None = 0.0):
        self.ctx = ctx = RoundContext(res, group, rank, flat, weight, codec, gcodec, cfg, aggregation, absmax)
        self.owner = Owner(ctx, absmax) if ctx.is_owner else None
        self.sender = Sender(ctx) if self.owner is None else Sender(ctx, self.owner.gone)

    async def serve_sender(self, stream: Stream) -> None:
        """A sender's stream into our shard (from the service's stream handler)."""
        try:
            rank = self.ctx.group.rank_of(stream.peer_id)
        except KeyError:
            stream.reset("not a member of this group")
            return
        if self.owner is None or rank == self.ctx.rank:
            stream.reset("this member owns no shard")
            return
        await self.owner.serve(stream, rank)

    def member_left(self, peer: PeerID) -> None:
        """``peer`` (a member, or ignored) left the round before its data were in."""
        try:
            j = self.ctx.group.rank_of(peer)
        except KeyError:
            return
        if self.owner is not None and j != self.ctx.rank:
            self.owner.left(j)

    def _on_disconnect(self, peer: PeerID) -> None:
        """The last connection to ``peer`` closed. If it is a member that has not opened its
        stream to us yet, it never will: this catches the member that dies after our own
        exchange with it succeeded (or while a second connection to it still looked open)."""
        try:
            j = self.ctx.group.rank_of(peer)
        except KeyError:
            return
        if self.owner is not None:
            self.owner.gone(j, "connection lost")

    async def run(self) -> AllReduceResult:
        ctx = self.ctx
        sends: list[asyncio.Task] = []
        unsubscribe = ctx.res.host.on_disconnect(self._on_disconnect)
        try:
            async with asyncio.TaskGroup() as tg:
                for j, (a, b) in enumerate(ctx.bounds):
                    if j != ctx.rank and b > a:
                        sends.append(tg.create_task(self.sender.send_part(j)))
                if self.owner is not None:
                    tg.create_task(self.owner.run())
        except* InputRefused as eg:  # (the other tasks are cancelled; the service aborts the rest)
            raise CompressionError(f"flat cannot be averaged; refusing it (found during the round, after part of "
                                   f"it went out): {eg.exceptions[0]}") from None
        finally:
            unsubscribe()
        total = time.monotonic() - ctx.t0
        shards: list[ShardResult] = [t.result() for t in sends]
        if self.owner is not None and self.owner.result is not None:
            shards.append(self.owner.result)
        shards.sort(key=lambda s: s.owner)
        ok = [s.weight for s in shards if s.status == "ok"]
        return AllReduceResult(
            group_id=ctx.group.group_id, group_size=ctx.size,
            members=tuple(m.peer_id for m in ctx.group.members), rank=ctx.rank, shards=shards,
            failed=dict(sorted(ctx.failed.items())), weight_total=min(ok) if ok else ctx.weight,
            bytes_sent=ctx.bytes_sent, bytes_received=ctx.bytes_received, time_total=total,
            time_reduce=min(ctx.t_reduce, total), time_gather=max(0.0, total - ctx.t_reduce),
            buffer_bytes=ctx.buffer_bytes, weights=declared_weights(ctx.group, ctx.weight), aggregation=ctx.agg,
        )

    def abort(self, reason: str) -> None:
        """Reset every stream whose exchange did not finish (finished ones are left alone: the
        remote may still be reading what we wrote before our EOF)."""
        if self.owner is not None:
            self.owner.abort(reason)

    def kept_buffers(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """What the service may keep for its next rounds once this one is over: the shard
        accumulator it lent (None where we summed in ``flat``) and the wire buffers (none of a device
        ``flat``'s: those are pinned, from torch's cache)."""
        acc = None
        if self.owner is not None and not self.owner.reducer.in_place:
            acc = self.owner.reducer.acc
        return acc, [] if self.ctx.staged else self.ctx.wires
