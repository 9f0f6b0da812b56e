"""What both sides of one member's all-reduce round share (:mod:`.owner`, :mod:`.sender`, and the
round's lifecycle in :mod:`.round`): the round's parameters, its resources, the failures seen so far,
byte and time accounting, and where codec work runs (ONE worker thread, FIFO, or inline on the loop
where the process has no core to spare)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dht import Stream

from ..compression import Codec
from ..compression.device import host_buffer
from .group import Group, counted_weight, partition, weight_cap
from .ledger import chunks as _chunks
from .round_types import AllReduceConfig, RoundResources, base_codec, codec_id

if TYPE_CHECKING:
    from .ledger import Ledger

__all__ = ["RoundContext", "retrieve", "staged"]

log = logging.getLogger("p2ptrain.allreduce")

_EMPTY = torch.empty(0, dtype=torch.float32)


def staged(flat: torch.Tensor) -> bool:
    """Whether a round over ``flat`` takes the device path: where ``flat`` is not on the CPU, what
    we send is encoded and replies decoded on the device (:mod:`.sender`) and our own shard is
    reduced in a host copy (:mod:`.owner`). (Tests force it on for CPU tensors: the same results.)"""
    return flat.device.type != "cpu"


def retrieve(fut: asyncio.Future | None) -> None:
    """Cancel a prefetch nobody will await (no 'exception was never retrieved' reports)."""
    if fut is not None and not fut.cancel() and fut.done() and not fut.cancelled():
        fut.exception()


class RoundContext:
    """Holds no reference to the sides that share it: a round's objects form no reference cycle,
    so its buffers are freed (and reused by the allocator) as soon as the round is dropped."""

    def __init__(self, res: RoundResources, group: Group, rank: int, flat: torch.Tensor, weight: float,
                 codec: Codec, gcodec: Codec, cfg: AllReduceConfig, aggregation: str = "mean",
                 absmax: float | None = 0.0):
        weight = counted_weight(group.members[rank], weight, weight_cap(group.members, weight))  # as others count it
        self.res, self.group, self.rank, self.flat, self.weight, self.cfg = res, group, rank, flat, weight, cfg
        self.codec, self.gcodec = codec, gcodec
        # None: ``run`` did not check ``flat``: the encodes of what we send check it, and our own
        # shard is checked where it is first read (see :mod:`.reducer`)
        self.input_checked = absmax is not None
        self.staged = staged(flat)
        # wire buffers: pinned (torch caches them) where bytes cross from a device, else the service's
        self.take_wire: Callable[[int], torch.Tensor] = host_buffer if self.staged else res.take_wire
        self.rmeta, self.gmeta = base_codec(codec)._meta(_EMPTY), gcodec._meta(_EMPTY)
        self.n = n = flat.numel()
        self.size = group.size
        self.cn = -(-max(1, int(cfg.chunk_numel)) // 256) * 256
        self.bounds = partition(n, group.members) if n else [(0, 0)] * group.size
        self.offload = (cfg.offload_min_numel is not None and n >= cfg.offload_min_numel
                        and res.cpus >= cfg.offload_min_cpus)
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
        self.failed: dict[int, str] = {}  # for the report: any rank we gave up on, either role
        self.buffer_bytes = 0
        self.bytes_sent = self.bytes_received = 0
        self.t_reduce = 0.0
        self.wires: list[torch.Tensor] = []  # wire buffers taken from the service's pool
        self._nbytes: dict[tuple[int, int], int] = {}
        self.ledger: Ledger | None = None  # robust rules: what we keep for auditors (set by the service)

    def enc_nbytes(self, codec: Codec, numel: int) -> int:
        key = (id(codec), numel)
        nb = self._nbytes.get(key)
        if nb is None:
            nb = self._nbytes[key] = codec.encoded_nbytes(numel)
        return nb

    async def compute(self, fn: Callable, *args: Any) -> Any:
        if self.offload:
            return await asyncio.get_running_loop().run_in_executor(self.res.executor, fn, *args)
        return fn(*args)

    def submit(self, fn: Callable, *args: Any) -> asyncio.Future:
        if self.offload:
            return asyncio.get_running_loop().run_in_executor(self.res.executor, fn, *args)
        return self.inline(fn, *args)

    def inline(self, fn: Callable, *args: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def fail(self, rank: int, reason: str) -> None:
        if rank not in self.failed:
            self.failed[rank] = reason
            log.info("all-reduce %s: rank %d: %s", self.group.group_id.hex()[:8], rank, reason)

    def account(self, stream: Stream) -> None:
        self.bytes_sent += stream.bytes_sent
        self.bytes_received += stream.bytes_received

    def wire_pair(self, codec: Codec, numel: int) -> list[torch.Tensor | None]:
        """Two wire buffers for a pipeline of ``codec`` encodes of chunks of up to ``numel`` values
        (chunk ``ci`` uses ``ci % 2``: it is written out before chunk ``ci + 2`` is encoded),
        from the service's pool and back to it after the round; None where the codec has no use."""
        if not (base_codec(codec).uses_out and numel):
            return [None, None]
        pair = [self.take_wire(self.enc_nbytes(codec, numel)) for _ in range(2)]
        self.wires += pair
        self.buffer_bytes += sum(t.numel() for t in pair)
        return pair
