"""Runs all-reduce rounds for one host: ``AllReduceService`` owns the stream handler of protocol
``p2ptrain/allreduce/1``, the registry of rounds in progress (streams may arrive before the local
round starts), the worker thread for codec work, and the buffers kept between rounds (a fresh
state-sized buffer costs a page fault per 4 KiB), lent to each round as one ``RoundResources``.
One round's lifecycle is in :mod:`.round`. Under a robust rule it also keeps each round's
:class:`.ledger.Ledger`, serves the others' audits from it (``p2ptrain/allreduce-audit/1``) and
audits the other owners after each round (:mod:`.audit`) before ``run`` returns.

>>> service = AllReduceService(host)              # registers the stream handler once
>>> await service.start()
>>> result = await service.run(group, my_rank, flat, weight=samples, codec="int8")
>>> result.ok, result.failed, result.not_averaged   # flat now holds the weighted mean
>>> await service.close()
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from dht import DHTError, Host, PeerID, Stream, TaskGroup, usable_cpus

from ..compression import Codec, CompressionError, get_codec
from ..compression.base import abs_max
from ..deadlines import ROUND, LinkMeter
from .audit import AUDIT_PROTOCOL, AuditConfig, audit_round
from .audit import serve as serve_audit
from .group import Group, Member
from .ledger import Ledger
from .robust import MIN_ROBUST_GROUP, check_aggregation, check_codec
from .protocol import PROTOCOL
from .round import Round
from .round_types import AllReduceConfig, AllReduceResult, RoundResources, base_codec

__all__ = ["MAX_WAITING_PER_PEER", "AllReduceService"]

log = logging.getLogger("p2ptrain.allreduce")

#: default seconds without a round before an all-reduce service lets its kept buffers go
POOL_IDLE = 60.0

#: streams one peer may have waiting for rounds that have not started here (see _on_stream)
MAX_WAITING_PER_PEER = 4
LEFT_METHOD = "p2ptrain.ar.left"  # a member tells the others it takes no part in rounds (leave)
MAX_LEFT_GROUPS = 256  # group ids one leave notice may name (a slice each)
LEFT_TIMEOUT = 5.0  # s: telling a member we left is best effort


def _noop() -> None:
    pass


def _group_id(stream: Stream) -> Any:
    hdr = stream.header
    return hdr.get("g") if isinstance(hdr, dict) else None


class AllReduceService:
    """Runs all-reduce rounds on ``host``: owns the stream handlers (rounds and their audits), the
    registry of rounds in progress (keyed by group id), the worker thread, and every task it
    starts. ``audit``: how rounds under a robust rule are audited (:mod:`.audit`)."""

    def __init__(self, host: Host, config: AllReduceConfig | None = None, *, accept_wait: float = 5.0,
                 max_waiting_groups: int = 256, audit: AuditConfig | None = None):
        self.host = host
        self.config = config or AllReduceConfig()
        self.audit = audit or AuditConfig()
        self.link = LinkMeter()  # this host's link, timed on its rounds: rounds' deadlines derive from it
        # the ledgers of our last ``audit.kept`` audited rounds, for the others' audits (ledger.py)
        self._ledgers: collections.OrderedDict[bytes, Ledger] = collections.OrderedDict()
        self._ledger_bufs: list[torch.Tensor] = []  # their buffers, kept between rounds like _scratch
        self._audit_streams: collections.Counter[tuple[bytes, PeerID]] = collections.Counter()
        self.max_waiting_groups = max_waiting_groups
        self._rounds: dict[bytes, Round] = {}
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._waiting_by_peer: collections.Counter[PeerID] = collections.Counter()  # streams waiting, per sender
        self._finished: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        #: members that said they left a round not started here yet (``leave``), per group id
        self._left: collections.OrderedDict[bytes, set[PeerID]] = collections.OrderedDict()
        self._tasks = TaskGroup("all-reduce service", log=log)  # rounds and stream handlers, while they run
        self._closed = False
        # One shard-sized accumulator kept between rounds: a fresh 100+ MB tensor costs a page
        # fault per 4 KiB on first touch (~40k faults, a measurable share of a round's CPU time).
        self._scratch: list[torch.Tensor] = []  # (at most one)
        self._wires: list[torch.Tensor] = []  # encoded-chunk buffers kept the same way
        #: seconds without a round after which the kept buffers go back to the system
        self.pool_idle = POOL_IDLE
        self._idle: asyncio.TimerHandle | None = None
        # lent to every round; the extension points call through, so a subclass or an instance
        # that replaces one of the methods (p2ptrain.testing.hostile) reaches every round
        self.resources = RoundResources(
            self.host, accept_wait, usable_cpus(), self._take_wire, self._take_scratch,
            before_chunk=lambda owner, index: self._before_chunk(owner, index),
            outgoing=lambda owner, index, views: self._outgoing(owner, index, views),
            reply=lambda index, data: self._reply(index, data))

    @property
    def accept_wait(self) -> float:
        """Seconds a stream may wait for its round to start here."""
        return self.resources.accept_wait

    @accept_wait.setter
    def accept_wait(self, value: float) -> None:
        self.resources.accept_wait = value

    @property
    def cpus(self) -> int:
        """Usable CPUs: rounds offload codec work to the worker thread only with enough of them."""
        return self.resources.cpus

    @cpus.setter
    def cpus(self, value: int) -> None:
        self.resources.cpus = value

    _SCRATCH_MIN = 1 << 18  # smaller accumulators are not worth keeping
    _WIRES_KEPT = 32  # wire buffers kept between rounds (two per part a round encodes at once)

    @staticmethod
    def _take(kept: list[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A kept buffer of at least ``numel`` values and at most twice that, out of ``kept`` (it
        is back once the round is over), else a fresh one."""
        for i, t in enumerate(kept):
            if numel <= t.numel() <= 2 * numel:
                return kept.pop(i)
        return torch.empty(numel, dtype=dtype)

    def _take_scratch(self, numel: int) -> torch.Tensor:
        return self._take(self._scratch, numel, torch.float32)[:numel]

    def _take_wire(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer for encoded chunks (sliced by the codec that writes it)."""
        return self._take(self._wires, nbytes, torch.uint8)

    def _give_back_scratch(self, rnd: Round) -> None:
        """Keep ``rnd``'s accumulator and wire buffers for the next round once no work of ``rnd``
        can touch them: the worker is FIFO, so a no-op submitted now runs after every job ``rnd``
        queued."""
        acc, wires = rnd.kept_buffers()
        keep_acc = not (acc is None or acc.numel() < self._SCRATCH_MIN)
        base = (acc._base if acc._base is not None else acc) if keep_acc else None
        if self._closed or (base is None and not wires):
            return

        def put(_f: asyncio.Future | None = None) -> None:
            if not self._closed:
                if base is not None:
                    self._scratch = [base]
                self._wires = (self._wires + wires)[-self._WIRES_KEPT:]
                if self._idle is not None:
                    self._idle.cancel()
                self._idle = asyncio.get_running_loop().call_later(self.pool_idle, self._release_idle)
        if not rnd.ctx.offload:
            put()
            return
        try:
            fut = asyncio.get_running_loop().run_in_executor(self.resources.executor, _noop)
        except RuntimeError:  # executor shut down
            return
        fut.add_done_callback(put)

    def _release_idle(self) -> None:
        """No round for ``pool_idle`` seconds: let the kept buffers go (a round in flight keeps them)."""
        self._idle = None
        if not self._rounds:
            self._scratch, self._wires = [], []

    async def start(self) -> None:
        self.resources.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="allreduce")
        self.host.on_stream(PROTOCOL, self._on_stream)
        self.host.on_stream(AUDIT_PROTOCOL, self._on_audit_stream)
        self.host.on_request(LEFT_METHOD, self._on_left)

    async def __aenter__(self) -> AllReduceService:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel every round and handler this service runs and stop its worker thread."""
        if self._closed:
            return
        self._closed = True
        self.host.off_stream(PROTOCOL)
        self.host.off_stream(AUDIT_PROTOCOL)
        self.host.off_request(LEFT_METHOD, self._on_left)
        for rnd in list(self._rounds.values()):
            rnd.abort("all-reduce service closing")
        await self._tasks.close()
        if self.resources.executor is not None:
            self.resources.executor.shutdown(wait=True, cancel_futures=True)
        if self._idle is not None:
            self._idle.cancel()
        self._scratch, self._wires = [], []
        self._ledgers.clear()
        self._ledger_bufs = []

    async def _before_chunk(self, owner: int, index: int) -> None:
        """Extension point, awaited before each chunk a sender writes (a slow or dying sender)."""

    def _outgoing(self, owner: int, index: int, views: list[memoryview]) -> list[memoryview]:
        """Extension point on the wire bytes of each chunk a sender writes (a hostile sender, e.g.
        NaN payloads, which ``run`` would refuse to take from ``flat``)."""
        return views

    def _reply(self, index: int, data: Any) -> Any:
        """Extension point on the reply bytes of each chunk of our shard an owner writes (an owner
        that tampers with its result: ``p2ptrain.testing.hostile.shards``)."""
        return data

    def _audit_values(self, kind: str, x: int, y: int, values: torch.Tensor) -> torch.Tensor:
        """Extension point on the values of each audit answer (a member that lies to auditors)."""
        return values

    # ------------------------------------------------------------------ audits (audit.py)
    def _new_ledger(self, rnd: Round, weight: float, codec: Codec) -> Ledger:
        """A ledger for ``rnd``, kept for the others' audits in place of the oldest one kept, whose
        buffers it reuses (so that ``audit.kept`` ledgers is all this service holds)."""
        while len(self._ledgers) >= max(1, self.audit.kept):
            _, old = self._ledgers.popitem(last=False)
            self._ledger_bufs = (self._ledger_bufs + old.buffers)[-2:]
        self._audit_streams = collections.Counter({k: v for k, v in self._audit_streams.items()
                                                   if k[0] in self._ledgers})
        ctx = rnd.ctx
        ledger = self._ledgers[ctx.group.group_id] = Ledger(
            ctx.group, ctx.rank, weight, ctx.bounds, ctx.cn, base_codec(codec), ctx.rmeta,
            lambda nbytes: self._take(self._ledger_bufs, nbytes, torch.uint8))
        return ledger

    async def _on_audit_stream(self, stream: Stream) -> None:
        with self._tasks.adopt():
            gid = _group_id(stream)
            ledger = self._ledgers.get(gid) if isinstance(gid, bytes) else None
            if ledger is None:
                stream.reset("no audited round of that group held here")
                return
            peer = stream.peer_id
            if peer == self.host.peer_id or all(m.peer_id != peer for m in ledger.group.members):
                stream.reset("not a member of that group")
                return
            if self._audit_streams[(gid, peer)] >= self.audit.max_streams:
                stream.reset("too many audit streams for that round")
                return
            self._audit_streams[(gid, peer)] += 1
            cfg = self.config
            wait = ROUND.ceiling if cfg.timeout is None else cfg.timeout  # (its round's end cuts it short)
            await serve_audit(ledger, stream, wait, max(cfg.stall_timeout, cfg.read_timeout(1 << 22)),
                              lambda kind, x, y, values: self._audit_values(kind, x, y, values))

    # ------------------------------------------------------------------ incoming streams
    async def _on_stream(self, stream: Stream) -> None:
        with self._tasks.adopt():
            gid = _group_id(stream)
            if not isinstance(gid, bytes) or len(gid) > 64:
                stream.reset("malformed header")
                return
            rnd = self._rounds.get(gid)
            if rnd is None:
                if gid in self._finished:  # (or left: see leave)
                    stream.reset("round already finished")
                    return
                peer = stream.peer_id
                if self._waiting_by_peer[peer] >= MAX_WAITING_PER_PEER:
                    # An honest member is at most a round or two ahead of us; a peer holding more
                    # streams for rounds that never start is filling the registry for others.
                    stream.reset("too many streams for rounds that have not started here")
                    return
                fut = self._waiting.get(gid)
                if fut is None:
                    if len(self._waiting) >= self.max_waiting_groups:
                        stream.reset("too many unknown groups")
                        return
                    fut = self._waiting[gid] = asyncio.get_running_loop().create_future()
                self._waiting_by_peer[peer] += 1
                try:
                    rnd = await asyncio.wait_for(asyncio.shield(fut), self.accept_wait)
                    if rnd is None:
                        stream.reset("this member left the round")
                        return
                except TimeoutError:
                    if self._waiting.get(gid) is fut:
                        del self._waiting[gid]
                        fut.cancel()
                    stream.reset("unknown group")
                    return
                finally:
                    self._waiting_by_peer[peer] -= 1
                    if not self._waiting_by_peer[peer]:
                        del self._waiting_by_peer[peer]
            await rnd.serve_sender(stream)

    # ------------------------------------------------------------------ leaving a round
    def leave(self, group: Group, gids: Sequence[bytes]) -> None:
        """We take no part in the rounds ``gids`` of ``group`` after all (a round begun early whose
        data never came): their streams to us are refused at once, and the other members are told,
        so that they stop waiting for our parts instead of sitting out ``join_timeout``."""
        if self._closed:
            return
        for gid in gids:
            self._finished[gid] = None
            waiting = self._waiting.pop(gid, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)
        while len(self._finished) > 1024:
            self._finished.popitem(last=False)
        args = {"g": list(gids[:MAX_LEFT_GROUPS])}
        for m in group.members:
            if m.peer_id != self.host.peer_id and m.reach:
                self._tasks.spawn(self._tell_left(m, args))

    async def _tell_left(self, member: Member, args: dict[str, Any]) -> None:
        try:
            await self.host.call(member.peer_id, member.addr, LEFT_METHOD, args, timeout=LEFT_TIMEOUT,
                                 relays=member.relays)
        except (DHTError, OSError) as e:  # (an older peer answers no such method: it times out as before)
            log.debug("could not tell %s we left: %s", member.peer_id, e)

    async def _on_left(self, conn: Any, args: Any) -> None:
        """A member left rounds of ours (untrusted: only its own place in groups it is a member of)."""
        gids = args.get("g") if isinstance(args, dict) else None
        if not isinstance(gids, list) or len(gids) > MAX_LEFT_GROUPS or conn.remote_peer is None:
            raise ValueError("malformed leave notice")
        for gid in gids:
            if not isinstance(gid, bytes) or len(gid) > 64:
                raise ValueError("malformed leave notice")
            rnd = self._rounds.get(gid)
            if rnd is not None:
                rnd.member_left(conn.remote_peer)  # (a peer not in the group is ignored there)
            elif gid not in self._finished:  # not started here yet: it starts without that member
                self._left.setdefault(gid, set()).add(conn.remote_peer)
                while len(self._left) > 1024:
                    self._left.popitem(last=False)

    # ------------------------------------------------------------------ rounds
    async def run(self, group: Group, my_rank: int, flat: torch.Tensor, weight: float = 1.0,
                  codec: Codec | str = "none", *, gather_codec: Codec | str | None = None,
                  timeout: float | None = None, config: AllReduceConfig | None = None,
                  aggregation: str = "mean") -> AllReduceResult:
        """Average ``flat`` (a flat contiguous float32 tensor, overwritten with the result) with
        the other members of ``group``, weighted by ``weight``. On a device, only wire bytes and
        our own shard cross to the host (:func:`.context.staged`). ``codec`` compresses the reduce phase;
        ``gather_codec`` the returned averages (default: the same codec, but ``fp16`` for ``topk``,
        whose sparsification of an average would lose most of it). Never raises because of what a
        peer did: failures are in the result. ``aggregation``: ``mean`` (streaming, the default)
        or a robust rule of :mod:`.robust`; every member must use the same. Raises ValueError for
        bad arguments, CompressionError if ``flat`` holds NaN/inf (found before anything is sent,
        except with ``int8``, whose encode checks each chunk it sends: then a NaN/inf ends the
        round where the round first reads it, when its chunk is encoded or, in our own shard, when
        the first contribution to its chunk is added, as do own values so large that this sum
        could overflow float32; the others count us as failed mid-round, and ``flat`` is left as a
        cancelled round leaves it), RuntimeError once closed. A
        round cancelled midway leaves ``flat`` part input, part result (and under ``mean`` with a
        ``none`` or ``int8`` reply, an owner sums into its own shard of ``flat``): keep a copy if the
        input is needed after a cancellation."""
        if self._closed or self.resources.executor is None:
            raise RuntimeError("AllReduceService is not running (call start())")
        check_aggregation(aggregation)
        cfg = config or self.config
        if timeout is not None:
            cfg = dataclasses.replace(cfg, timeout=float(timeout))
        codec = get_codec(codec) if isinstance(codec, str) else codec
        if gather_codec is None:
            gather_codec = get_codec("fp16") if base_codec(codec).name == "topk" else base_codec(codec)
        elif isinstance(gather_codec, str):
            gather_codec = get_codec(gather_codec)
        gather_codec = base_codec(gather_codec)  # stateless: no error feedback on averages
        check_codec(aggregation, base_codec(codec).name)
        if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.float32 and flat.dim() == 1
                and flat.is_contiguous()):
            raise ValueError("flat must be a 1-D contiguous float32 tensor")
        if cfg.timeout is None:
            payload = round_payload(flat.numel(), cfg.chunk_numel, codec, gather_codec)
            cfg = dataclasses.replace(cfg, timeout=self.link.deadline(ROUND, payload))
        weight = float(weight)
        if not (0 < weight <= cfg.max_weight):
            raise ValueError(f"weight must be finite, > 0 and <= {cfg.max_weight:g}, got {weight}")
        if not 0 <= my_rank < group.size or group.members[my_rank].peer_id != self.host.peer_id:
            raise ValueError(f"rank {my_rank} of group {group.group_id.hex()} is not this host")
        if group.group_id in self._rounds or group.group_id in self._finished:
            raise ValueError(f"group {group.group_id.hex()} already ran on this service; group ids are single-use")
        # One pass: min/max propagate NaN, and bound our own values for _accumulate. With a codec
        # whose encode refuses NaN/inf in the pass that reads each chunk (int8), no pass at all:
        # what we send is checked by its encode, our own shard where the round first reads each
        # of its chunks (see reducer.py).
        absmax: float | None = None
        if not (base_codec(codec).encode_checks_finite and aggregation == "mean"):
            absmax = abs_max(flat) if flat.numel() else 0.0
            if not absmax < float("inf"):  # NaN compares false
                raise CompressionError("flat contains NaN or inf; refusing to average it")
        rnd = Round(self.resources, group, my_rank, flat, weight, codec, gather_codec, cfg, aggregation, absmax)
        gid = group.group_id
        ledger = None
        if aggregation != "mean" and self.audit.chunks > 0 and group.size >= MIN_ROBUST_GROUP:
            ledger = rnd.ctx.ledger = self._new_ledger(rnd, weight, codec)
        self._rounds[gid] = rnd
        for peer in self._left.pop(gid, ()):
            rnd.member_left(peer)
        waiting = self._waiting.pop(gid, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(rnd)
        with self._tasks.adopt():  # close() cancels the round
            try:
                async with asyncio.timeout(cfg.timeout + cfg.stall_timeout):
                    result = await rnd.run()
                if result.ok and not result.failed:  # (a round that waited on a failing peer times no link)
                    self.link.observe_transfer(result.bytes_sent + result.bytes_received, result.time_total)
                if ledger is not None:
                    ledger.finished.set()
                    try:
                        await audit_round(rnd.ctx, result, self.audit)
                    except TimeoutError:
                        log.warning("all-reduce %s: the audit of the owners' results ran out of time; the chunks not "
                                    "checked by then are kept as their owners sent them", gid.hex()[:8])
                return result
            finally:
                if ledger is not None:
                    ledger.finished.set()
                rnd.abort("round over")
                self._give_back_scratch(rnd)
                del self._rounds[gid]
                self._finished[gid] = None
                while len(self._finished) > 1024:
                    self._finished.popitem(last=False)


def round_payload(numel: int, chunk_numel: int, codec: Codec, gather_codec: Codec) -> int:
    """The most bytes a member sends and receives in a round of ``numel`` values: both phases'
    wire bytes, each way."""
    if numel <= 0:
        return 0
    per = min(numel, chunk_numel)
    return 2 * -(-numel // per) * (codec.encoded_nbytes(per) + gather_codec.encoded_nbytes(per))
