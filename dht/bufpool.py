"""Reusable frame buffers shared by a host's connections (``BufferPool``).

Why: a multi-MiB buffer per frame, allocated and freed, costs page faults on every reuse; a pool
that hands a buffer out again only once nothing references it needs no release calls from its
users (a decrypted frame's consumer, the socket transport) and cannot hand out bytes in use.
"""

from __future__ import annotations

import sys

__all__ = ["BufferPool", "POOLED_FRAME_MIN"]

#: stream data frames at least this large are encrypted/decrypted into pooled buffers
POOLED_FRAME_MIN = 256 * 1024


class BufferPool:
    """Frame-sized bytearrays handed out again once nothing references them any more.

    Allocating a fresh multi-MiB buffer per frame churns malloc: freed memory goes back to the
    kernel and every reuse page-faults (~1000 faults per 4 MiB frame). A buffer here is reused only
    when the pool holds the one reference left: a consumer still holding a view of a decrypted frame
    (a memoryview or a tensor over it), or the socket transport still queueing an encrypted frame,
    keeps it out of reuse, so no one ever sees its bytes change underneath.

    Buffers are sized to what is asked (rounded up to ``granule``), not all to the largest frame:
    an int8 all-reduce sends ~1 MiB frames, which would each pin a 4 MiB buffer. A request takes an idle buffer
    of at least its size and at most twice it; when the pool is full, idle buffers of other sizes
    make room for a new size (the traffic changed), so the pool follows the frames in use. Requests
    over half the largest size all get that size: a whole received frame, a full frame's plaintext
    and its ciphertext differ by a few bytes, and as three sizes they could not use each other's
    idle buffers. The pool keeps at most ``keep`` buffers and at
    most ``max_bytes`` of them: a count alone that is enough for the ~1 MiB frames of an int8
    round would let 4 MiB frames pin four times the memory.
    """

    __slots__ = ("size", "keep", "max_bytes", "granule", "_big", "_bufs", "_bytes", "_idle_refs")

    def __init__(self, size: int, keep: int, granule: int = 64 << 10, max_bytes: int | None = None):
        self.size = size  # the largest buffer asked for (a whole frame)
        self.keep = keep  # at most this many buffers kept ...
        self.max_bytes = max_bytes  # ... and at most this many bytes of them (None: no limit)
        self._bytes = 0  # what the kept buffers hold
        self._big = -(-size // granule) * granule  # the one size of every buffer over half of it
        self.granule = granule
        self._bufs: list[bytearray] = [bytearray(0)]
        self._idle_refs = self._refs(0)  # what an unreferenced pooled buffer counts, on this Python
        self._bufs.clear()

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self._bufs[i])

    def get(self, n: int | None = None) -> bytearray:
        """A buffer of at least ``n`` bytes (default: ``size``); slice what you need. Larger
        requests than ``size`` get a buffer of their own, not kept."""
        if n is not None and n > self.size:
            return bytearray(n)
        want = self._big if n is None else -(-max(n, 1) // self.granule) * self.granule
        if n is None or 2 * n > self._big:
            want = self._big
        # at most twice what is asked (not twice ``want``): a received frame stays in its buffer
        # only while that holds, else Connection copies it out (the bound Limits states)
        top = 2 * want if n is None else max(want, 2 * n)
        bufs = self._bufs
        for i in range(len(bufs)):  # (by index: a loop variable would count as a reference)
            if self._refs(i) <= self._idle_refs and want <= len(bufs[i]) <= top:
                return bufs[i]
        buf = bytearray(want)
        cap = self.max_bytes if self.max_bytes is not None else float("inf")
        # Full (by count or bytes): idle buffers, all of other sizes here, make room (the traffic
        # changed); buffers in use stay.
        i = len(bufs) - 1
        while (len(bufs) >= self.keep or self._bytes + want > cap) and i >= 0:
            if self._refs(i) <= self._idle_refs:
                self._bytes -= len(bufs[i])
                del bufs[i]
            i -= 1
        if len(bufs) < self.keep and self._bytes + want <= cap:
            bufs.append(buf)
            self._bytes += want
        return buf

    def clear(self) -> None:
        self._bufs.clear()
        self._bytes = 0
