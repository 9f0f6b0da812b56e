"""Averager: the public face of averaging — matchmaking through the DHT, then the all-reduce.

``await averager.step(weight=...)`` meets whoever averages the same tensors (same prefix, schema,
codec and aggregation rule) in the same round, averages with them, writes the result into the
tensors in place and says what happened. A peer that finds nobody keeps its tensors and gets
``group_size == 1``; it never hangs. ``BlockingAverager`` wraps it for ordinary synchronous training loops.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from dht import Contact, DHTNode, Multiaddr, PeerID

from ..background import parse_multiaddrs
from ..compression import get_codec
from ..loop import LoopThread
from .allreduce import AllReduceService
from .group import Group
from .matchmaking import Matchmaker
from .robust import MIN_ROBUST_GROUP, check_aggregation, check_codec
from .round_types import AllReduceConfig, AllReduceResult
from .schema import Schema, tensor_schema

log = logging.getLogger("p2ptrain.averager")

#: values per all-reduce of a round (64 MiB of fp32): the most a peer stages on the host at once
SLICE_NUMEL = 16 << 20
#: slices of a round averaged at once
SLICES_IN_FLIGHT = 2

TensorsLike = Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class StepResult:
    """What one averaging step did. ``allreduce`` holds the per-shard detail when a group formed."""

    round_id: str
    group_size: int
    members: list[PeerID]
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_s: float = 0.0  # forming the group (with an early start: only the wait after the data was in)
    group_s: float = 0.0  # forming the group, from the start of its matchmaking
    allreduce_s: float = 0.0
    total_s: float = 0.0
    weight_total: float = 0.0
    failed: dict[int, str] = field(default_factory=dict)
    not_averaged: list[int] = field(default_factory=list)  # ranks whose shard kept local values
    allreduces: list[AllReduceResult] = field(default_factory=list)  # one per slice of the round

    @property
    def allreduce(self) -> AllReduceResult | None:
        """The first slice's all-reduce (the group, ranks and weights every slice shares)."""
        return self.allreduces[0] if self.allreduces else None

    @property
    def averaged(self) -> bool:
        return self.group_size > 1 and not self.not_averaged


class EarlyStart:
    """A round whose matchmaking begins before its tensors hold the data (``Averager.step(start=)``),
    so that the group is formed by the time they do (hivemind's pre-scheduled steps): from any
    thread, ``go(weight)`` once the data are in, or ``leave()`` to take no part after all (a group
    formed meanwhile is told, and its others average without us at once)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._ready: asyncio.Future[tuple[float, float] | None] = loop.create_future()

    def go(self, weight: float) -> None:
        if not (weight > 0 and weight < float("inf")):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        self._loop.call_soon_threadsafe(self._settle, (float(weight), time.perf_counter()))

    def leave(self) -> None:
        self._loop.call_soon_threadsafe(self._settle, None)

    def _settle(self, value: tuple[float, float] | None) -> None:
        if not self._ready.done():
            self._ready.set_result(value)

    async def wait(self) -> tuple[float, float] | None:
        """The weight ``go`` gave and when (``time.perf_counter``); None once we left."""
        return await self._ready


class Averager:
    """Averages ``tensors`` in place with peers of the same ``prefix`` (e.g. the run id).

    A round averages the tensors, read as one flat vector, a slice of ``slice_numel`` values at
    a time (one all-reduce per slice within the group matchmaking formed). Tensors that are
    consecutive views of one contiguous fp32 buffer (see :func:`shared_flat`) are averaged in
    that buffer, with no copy (on a device too: only wire bytes and our shard cross to the host).
    Others may live on any device and have any float dtype: each slice is copied into a host fp32
    staging buffer and written back, so the host holds one slice, never a copy of everything.
    Peers meet only with the same ``slice_numel`` (it shapes the rounds) and ``tag`` (anything
    else the caller's peers must agree on), both part of the schema, as is ``shards``: the FSDP
    world size of a peer whose rank averages its shard of the model.
    """

    def __init__(
        self,
        dht: DHTNode,
        prefix: str,
        tensors: TensorsLike,
        *,
        codec: str = "none",
        aggregation: str = "mean",
        target_group_size: int = 16,
        min_group_size: int = 2,
        bandwidth: float = 1.0,
        matchmaking_timeout: float = 5.0,
        allreduce_config: AllReduceConfig | None = None,
        service: AllReduceService | None = None,
        slice_numel: int = SLICE_NUMEL,
        tag: str = "",
        shards: int = 1,
    ):
        if isinstance(tensors, Mapping):
            named = list(tensors.items())
        else:
            items = list(tensors)
            named = [(str(i), t) if isinstance(t, torch.Tensor) else t for i, t in enumerate(items)]
        if not named:
            raise ValueError("nothing to average: the tensor list is empty")
        for name, t in named:
            if not t.is_floating_point():
                raise TypeError(f"tensor {name!r} has dtype {t.dtype}: only floating-point tensors can be averaged")
        self.dht = dht
        self.prefix = prefix
        self.tensors = [t for _, t in named]
        self.codec_name = codec
        get_codec(codec)  # fail now, with the list of codecs, on a typo
        self.aggregation = check_aggregation(aggregation)
        check_codec(self.aggregation, codec)
        # The aggregation rule joins the codec in the schema (hence the matchmaking key): peers that
        # combine differently never meet, and a mismatch message names it with the codec.
        rule = codec if aggregation == "mean" else f"{codec}+{aggregation}"
        rule += f"/{tag}" if tag else ""  # (what else the peers must agree on: e.g. how rounds are timed)
        self.schema: Schema = tensor_schema(named, rule if slice_numel == SLICE_NUMEL else f"{rule}/{slice_numel}",
                                            shards=shards)
        self.matchmaking_timeout = matchmaking_timeout
        self.matchmaker = Matchmaker(dht, prefix, self.schema, target_group_size=target_group_size,
                                     min_group_size=min_group_size, bandwidth=bandwidth)
        # One all-reduce service per host serves every averager on it (it owns the stream
        # protocol); an averager given one shares it and leaves its lifetime to the owner.
        self._owns_service = service is None
        self.service = service if service is not None else AllReduceService(dht.host, allreduce_config)
        if slice_numel < 1:
            raise ValueError(f"slice_numel must be positive, got {slice_numel}")
        self._flat = shared_flat(self.tensors)
        self._slice_numel = slice_numel
        self._round = 0
        self._started = False

    async def start(self) -> None:
        if self._owns_service:
            await self.service.start()
        self._started = True

    async def close(self) -> None:
        await self.matchmaker.close()
        if self._owns_service:
            await self.service.close()

    async def __aenter__(self) -> Averager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def step(self, weight: float = 1.0, round_id: str | int | None = None,
                   timeout: float | None = None, expected: int | None = None,
                   on_group: Callable[[], None] | None = None, lock: AbstractContextManager | None = None,
                   on_write: Callable[[], None] | None = None, start: EarlyStart | None = None,
                   mates: Sequence[Contact] = ()) -> StepResult:
        """Average once. Peers meet by ``round_id`` (default: this averager's step counter, so
        peers that step together meet); ``timeout`` bounds the matchmaking; ``expected`` (peers
        known to come, us included) lets matchmaking stop as soon as they are all there. Under a
        robust aggregation rule groups smaller than 3 are refused unless ``expected`` says the
        swarm has only 2 peers (see :mod:`.robust`): such a peer gets a group of itself.
        ``on_group`` is called (on the event loop) once a group of two or more formed, as its
        all-reduce starts. ``lock``: the result is written into the tensors under it, a slice at
        a time (the staged path, even for tensors that share a buffer), each write followed by
        ``on_write()`` under the lock; a round that fails midway leaves every value either ours or
        the group's average. ``start``: matchmaking begins now, declaring ``weight`` (the most we
        will average with), and the all-reduce once ``start.go(w)`` says the tensors hold the data
        (``matchmaking_s`` is then the wait for the group after that, ``group_s`` the whole); with
        no ``go`` within ``timeout`` of the group, we leave it (a group of ourselves, nothing written;
        its others are told, see ``AllReduceService.leave``).
        ``mates``: peers expected in our group, told of our arrival directly (``Matchmaker.form_group``)."""
        if not self._started:
            await self.start()
        if not (weight > 0 and weight < float("inf")):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        rid = str(self._round if round_id is None else round_id)
        self._round += 1
        t0 = time.perf_counter()
        min_size = None
        if self.aggregation != "mean" and (expected is None or expected >= MIN_ROBUST_GROUP):
            # a pair cannot outvote a hostile member: see robust.py (a 2-peer swarm still pairs up)
            min_size = max(self.matchmaker.min_group_size, MIN_ROBUST_GROUP)
        group = await self.matchmaker.form_group(rid, timeout or self.matchmaking_timeout, expected, min_size,
                                                 weight=weight, mates=mates)  # (declared: caps weights)
        t1 = time.perf_counter()
        group_s = t1 - t0
        if (latency := self.matchmaker.board.measured_latency) is not None:  # the round's deadline counts it
            self.service.link.observe_latency(latency)
        members = [m.peer_id for m in group.members]
        if start is not None:
            # (at most the timeout again: the group's others wait about that long for our data)
            try:
                go = await asyncio.wait_for(start.wait(), timeout or self.matchmaking_timeout)
            except TimeoutError:
                go = None
            if go is None:  # we left: the group's others go on without us, told so at once
                if group.size > 1:
                    slices = -(-self.schema.numel // self._slice_numel)
                    self.service.leave(group, [slice_group(group, k).group_id for k in range(slices)])
                return StepResult(rid, 1, [self.dht.peer_id], group_s=group_s)
            weight, ready = go  # (the wait for the group counts from the moment the data were in)
            t0, t1 = ready, max(ready, t1)
        if group.size == 1:
            return StepResult(rid, 1, members, matchmaking_s=t1 - t0, total_s=t1 - t0, weight_total=weight,
                              group_s=group_s)
        if on_group is not None:
            on_group()
        results = await self._slices(group, group.rank_of(self.dht.peer_id), weight, lock, on_write)
        t2 = time.perf_counter()
        return StepResult(
            rid, group.size, members,
            bytes_sent=sum(r.bytes_sent for r in results), bytes_received=sum(r.bytes_received for r in results),
            matchmaking_s=t1 - t0, allreduce_s=t2 - t1, total_s=t2 - t0, group_s=group_s,
            weight_total=min(r.weight_total for r in results),
            failed={k: v for r in results for k, v in r.failed.items()},
            not_averaged=sorted({o for r in results for o in r.not_averaged}), allreduces=results,
        )

    async def _slices(self, group: Group, rank: int, weight: float, lock: AbstractContextManager | None,
                      on_write: Callable[[], None] | None) -> list[AllReduceResult]:
        """One all-reduce per slice of ``_slice_numel`` values: in place in our shared buffer when
        there is one and no ``lock``, ``SLICES_IN_FLIGHT`` at a time (one fills its pipeline while
        the other drains), else one at a time through a host staging buffer (the host holds one
        slice); slice k runs as group ``slice_group(group, k)`` (every member derives the same)."""
        total, step = self.schema.numel, self._slice_numel
        in_place = self._flat is not None and lock is None
        spans = [(start, min(total, start + step)) for start in range(0, total, step)]
        free = [] if in_place else [torch.empty(min(total, step), dtype=torch.float32)]
        gate = asyncio.Semaphore(SLICES_IN_FLIGHT if in_place else 1)

        async def one(k: int, start: int, end: int) -> AllReduceResult:
            async with gate:
                if in_place:
                    assert self._flat is not None
                    return await self.service.run(slice_group(group, k), rank, self._flat[start:end], weight,
                                                  self.codec_name, aggregation=self.aggregation)
                staging = free.pop()
                try:
                    buf = staging[: end - start]
                    copy_slice(self.tensors, start, end, buf, into_tensors=False)
                    result = await self.service.run(slice_group(group, k), rank, buf, weight, self.codec_name,
                                                    aggregation=self.aggregation)
                    with lock if lock is not None else nullcontext():
                        copy_slice(self.tensors, start, end, buf, into_tensors=True)
                        if on_write is not None:
                            on_write()
                    return result
                finally:
                    free.append(staging)

        if len(spans) == 1:
            return [await one(0, *spans[0])]
        async with asyncio.TaskGroup() as tg:  # (a slice that fails cancels the others)
            tasks = [tg.create_task(one(k, start, end)) for k, (start, end) in enumerate(spans)]
        return [t.result() for t in tasks]


def shared_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one fp32 buffer (on any device) ``tensors`` are consecutive contiguous views of, from the
    first tensor's start to the last one's end, as a 1-D tensor; None if they are laid out otherwise."""
    first = tensors[0]
    storage = first.untyped_storage()
    ptr = first.data_ptr()
    for t in tensors:
        if not (t.dtype == torch.float32 and t.device == first.device and t.is_contiguous()
                and t.untyped_storage().data_ptr() == storage.data_ptr() and t.data_ptr() == ptr):
            return None
        ptr += t.numel() * 4
    numel = (ptr - first.data_ptr()) // 4
    out = torch.empty(0, dtype=torch.float32, device=first.device)
    return out.set_(storage, first.storage_offset(), (numel,)).detach()


def copy_slice(tensors: Sequence[torch.Tensor], start: int, end: int, buf: torch.Tensor, *,
               into_tensors: bool) -> None:
    """Copy values ``start:end`` of ``tensors`` (read as one flat vector) into ``buf``, or back."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            a, b = max(start, offset), min(end, offset + n)
            if a < b:
                src = t.detach()
                whole = src.view(-1) if src.is_contiguous() else src.reshape(-1)  # (else a copy)
                part = whole[a - offset : b - offset]
                if not into_tensors:
                    buf[a - start : b - start].copy_(part)
                elif whole.data_ptr() == src.data_ptr():
                    part.copy_(buf[a - start : b - start])
                else:  # a non-contiguous tensor: written back whole
                    part.copy_(buf[a - start : b - start])
                    src.copy_(whole.view(src.shape))
            offset += n
            if offset >= end:
                break


def slice_group(group: Group, k: int) -> Group:
    """Group ``group`` running the all-reduce of slice ``k`` of a staged round (a fresh id each)."""
    if k == 0:
        return group
    gid = hashlib.blake2b(group.group_id + b"/slice/" + str(k).encode(), digest_size=32).digest()
    return Group(gid, group.members)


class BlockingAverager:
    """An Averager for synchronous code: its DHT node and averaging run on a background loop.

    ``BlockingAverager(tensors, prefix="run", initial_peers=[...])`` creates and owns the DHT node;
    ``step()`` blocks until the round is done. ``close()`` (or ``with``) shuts everything down.
    """

    def __init__(self, tensors: TensorsLike, prefix: str, *, initial_peers: Sequence[str | Multiaddr] = (),
                 listen: tuple[str, int] | None = ("127.0.0.1", 0), **kwargs: object):
        peers = parse_multiaddrs(initial_peers)
        self._loop = LoopThread()
        try:
            self.dht = DHTNode(listen=listen)
            self._loop.run(self.dht.start(peers))
            self.averager = Averager(self.dht, prefix, tensors, **kwargs)  # type: ignore[arg-type]
            self._loop.run(self.averager.start())
        except BaseException:
            self._loop.run(self.dht.close()) if hasattr(self, "dht") else None
            self._loop.close()
            raise

    def step(self, weight: float = 1.0, round_id: str | int | None = None, timeout: float | None = None,
             expected: int | None = None) -> StepResult:
        return self._loop.run(self.averager.step(weight, round_id, timeout, expected))

    def close(self) -> None:
        try:
            self._loop.run(self.averager.close(), timeout=10)
            self._loop.run(self.dht.close(), timeout=10)
        finally:
            self._loop.close()

    def __enter__(self) -> BlockingAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
