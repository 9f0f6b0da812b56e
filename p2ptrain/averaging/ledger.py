"""What one member keeps of one robust all-reduce round so that the others can audit the owners
(see :mod:`.audit`): the bytes it sent each owner, chunk by chunk, and, as an owner, the rows it
combined for each chunk of its shard, with the weights it gave them.

Sans-IO: the round fills it (``sent`` on the event loop as each chunk goes out, ``combined`` in
the worker as each chunk of our shard is combined), the audit handler reads it. Memory: one buffer
of the encoded size of the parts we sent (about the vector's, less our own shard) and one of
``group size x our shard`` float32 values, both taken from the service's pool and given back
when the service drops the ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from ..compression import Codec, CompressionError
from .group import Group

__all__ = ["Ledger", "chunks"]


def chunks(start: int, end: int, cn: int) -> list[tuple[int, int]]:
    """The [a, b) chunks of ``cn`` values (the last shorter) that a shard is sent in."""
    return [(a, min(a + cn, end)) for a in range(start, end, cn)]


class Ledger:
    """One member's record of one round (``group``, our ``rank``, the ``weight`` we declared).
    ``take(nbytes)`` hands out a uint8 buffer of at least ``nbytes``; ``buffers`` lists them, for
    the service to take back."""

    def __init__(self, group: Group, rank: int, weight: float, bounds: list[tuple[int, int]], cn: int,
                 codec: Codec, meta: dict, take: Callable[[int], torch.Tensor]):
        self.group, self.rank, self.weight, self.bounds, self.cn = group, rank, weight, bounds, cn
        self.codec, self.meta = codec, meta  # the reduce codec (its base) and meta: to decode what we sent
        self._at: dict[tuple[int, int], tuple[int, int]] = {}  # (owner, chunk) -> (offset, nbytes)
        off = 0
        for j, (a, b) in enumerate(bounds):
            if j != rank:
                for ci, (ca, cb) in enumerate(chunks(a, b, cn)):
                    nb = codec.encoded_nbytes(cb - ca)
                    self._at[(j, ci)] = (off, nb)
                    off += nb
        s, e = bounds[rank]
        self.my_start, self.my_chunks = s, chunks(s, e, cn)
        self.buffers = [take(off), take(4 * group.size * (e - s))]  # (handed back as taken)
        self.sent_buf = self.buffers[0][:off]
        self.rows_buf = self.buffers[1][: 4 * group.size * (e - s)].view(torch.float32)
        self._sent: set[tuple[int, int]] = set()
        #: chunk of our shard -> (ranks in the order combined, the weight each counted with)
        self.rows: dict[int, tuple[list[int], list[float]]] = {}
        self.finished = asyncio.Event()  # our round is over: nothing more will be recorded

    # ------------------------------------------------------------------ filled by the round
    def sent(self, owner: int, ci: int, views: list[memoryview]) -> None:
        """The wire bytes of chunk ``ci`` of our part for ``owner``, as they went out."""
        at = self._at.get((owner, ci))
        if at is None:
            return
        off, nb = at
        dst, pos = self.sent_buf.numpy(), 0
        for v in views:
            v = memoryview(v).cast("B")
            k = min(len(v), nb - pos)
            dst[off + pos : off + pos + k] = v[:k]
            pos += k
        if pos == nb:
            self._sent.add((owner, ci))

    def combined(self, ci: int, ranks: list[int], x: torch.Tensor, w: torch.Tensor) -> None:
        """Owner side: the rows ``x`` (one per rank of ``ranks``, in order) that chunk ``ci`` of
        our shard was combined from, and their weights ``w``."""
        for i, r in enumerate(ranks):
            self._row(ci, r).copy_(x[i])
        self.rows[ci] = (list(ranks), [float(v) for v in w])

    # ------------------------------------------------------------------ read by the audit handler
    def sent_values(self, owner: int, ci: int) -> torch.Tensor | None:
        """What we sent ``owner`` for chunk ``ci`` of its shard, decoded as the owner decodes it;
        None if we did not send it whole."""
        if (owner, ci) not in self._sent:
            return None
        off, nb = self._at[(owner, ci)]
        a, b = chunks(*self.bounds[owner], self.cn)[ci]
        data = memoryview(self.sent_buf.numpy())[off : off + nb]
        if self.codec.wire_is_values and nb == 4 * (b - a):  # the values themselves: no copy
            return torch.frombuffer(data, dtype=torch.float32)
        try:
            return self.codec.decode(dict(self.meta, numel=b - a), data)
        except CompressionError:  # (what we sent decoded at the owner, or it dropped us)
            return None

    def row(self, ci: int, rank: int) -> tuple[float, torch.Tensor] | None:
        """Owner side: (weight, values) of ``rank``'s row in chunk ``ci`` of our shard as we combined
        it; None if that chunk was not combined (yet) or had no such row."""
        got = self.rows.get(ci)
        if got is None or rank not in got[0]:
            return None
        return got[1][got[0].index(rank)], self._row(ci, rank)

    def _row(self, ci: int, rank: int) -> torch.Tensor:
        a, b = self.my_chunks[ci]
        base = self.group.size * (a - self.my_start) + rank * (b - a)
        return self.rows_buf[base : base + b - a]
