"""Averager: the public face of averaging — matchmaking through the DHT, then the all-reduce.

``await averager.step(weight=...)`` meets whoever averages the same tensors (same prefix, schema,
codec and aggregation rule) in the same round, averages with them, writes the result into the
tensors in place and says what happened. A peer that finds nobody keeps its tensors and gets
``group_size == 1``; it never hangs. ``BlockingAverager`` wraps it for ordinary synchronous training loops.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from dht import DHTNode, Multiaddr, PeerID

from ..background import parse_multiaddrs
from ..compression import get_codec
from ..loop import LoopThread
from .allreduce import AllReduceService
from .matchmaking import Matchmaker
from .robust import MIN_ROBUST_GROUP, check_aggregation, check_codec
from .round_types import AllReduceConfig, AllReduceResult
from .schema import Schema, tensor_schema

log = logging.getLogger("p2ptrain.averager")

TensorsLike = Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class StepResult:
    """What one averaging step did. ``allreduce`` holds the per-shard detail when a group formed."""

    round_id: str
    group_size: int
    members: list[PeerID]
    bytes_sent: int = 0
    bytes_received: int = 0
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    total_s: float = 0.0
    weight_total: float = 0.0
    failed: dict[int, str] = field(default_factory=dict)
    not_averaged: list[int] = field(default_factory=list)  # ranks whose shard kept local values
    allreduce: AllReduceResult | None = None

    @property
    def averaged(self) -> bool:
        return self.group_size > 1 and not self.not_averaged


class Averager:
    """Averages ``tensors`` in place with peers of the same ``prefix`` (e.g. the run id).

    Tensors may live on any device and have any float dtype: they are gathered into one fp32 CPU
    buffer (the one copy the wire needs) and written back after the round.
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
        self.schema: Schema = tensor_schema(named, codec if aggregation == "mean" else f"{codec}+{aggregation}")
        self.matchmaking_timeout = matchmaking_timeout
        self.matchmaker = Matchmaker(dht, prefix, self.schema, target_group_size=target_group_size,
                                     min_group_size=min_group_size, bandwidth=bandwidth)
        # One all-reduce service per host serves every averager on it (it owns the stream
        # protocol); an averager given one shares it and leaves its lifetime to the owner.
        self._owns_service = service is None
        self.service = service if service is not None else AllReduceService(dht.host, allreduce_config)
        self._flat = torch.empty(self.schema.numel, dtype=torch.float32)
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

    def _gather(self) -> None:
        offset = 0
        for t in self.tensors:
            n = t.numel()
            self._flat[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n

    def scatter(self) -> None:
        """Write the last round's result into the tensors (what ``step(scatter=False)`` skipped)."""
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                n = t.numel()
                t.copy_(self._flat[offset : offset + n].view_as(t))
                offset += n

    async def step(self, weight: float = 1.0, round_id: str | int | None = None,
                   timeout: float | None = None, expected: int | None = None, scatter: bool = True,
                   on_group: Callable[[], None] | None = None) -> StepResult:
        """Average once. Peers meet by ``round_id`` (default: this averager's step counter, so
        peers that step together meet); ``timeout`` bounds the matchmaking; ``expected`` (peers
        known to come, us included) lets matchmaking stop as soon as they are all there. Under a
        robust aggregation rule groups smaller than 3 are refused unless ``expected`` says the
        swarm has only 2 peers (see :mod:`.robust`): such a peer gets a group of itself.
        ``scatter=False`` leaves the tensors as they were and the result in the averager until
        :meth:`scatter`, so a caller can write it back under its own lock. ``on_group`` is called
        (on the event loop) once a group of two or more formed, as its all-reduce starts."""
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
                                                 weight=weight)  # declared: the group caps weights by it
        t1 = time.perf_counter()
        if (latency := self.matchmaker.board.measured_latency) is not None:  # the round's deadline counts it
            self.service.link.observe_latency(latency)
        members = [m.peer_id for m in group.members]
        if group.size == 1:
            return StepResult(rid, 1, members, matchmaking_s=t1 - t0, total_s=t1 - t0, weight_total=weight)
        if on_group is not None:
            on_group()
        self._gather()
        result = await self.service.run(group, group.rank_of(self.dht.peer_id), self._flat, weight, self.codec_name,
                                       aggregation=self.aggregation)
        if scatter:
            self.scatter()
        t2 = time.perf_counter()
        return StepResult(
            rid, group.size, members,
            bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
            matchmaking_s=t1 - t0, allreduce_s=t2 - t1, total_s=t2 - t0,
            weight_total=result.weight_total, failed=dict(result.failed),
            not_averaged=result.not_averaged, allreduce=result,
        )


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
