"""The download schedule of a fetch, sans-IO: which chunks are still needed and who fetches what."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any


class ChunkSchedule:
    """Which chunks are still needed and who is fetching what. No IO, no clocks.

    Chunks are handed out as contiguous segments (one stream request each). A provider reports
    chunks as verified in order; when its request ends early (failure), the unverified rest of
    its segment goes back to the front of the queue for someone else. Chunks in ``have`` (the
    downloader holds them already, e.g. from an interrupted fetch) are never handed out.
    """

    def __init__(self, num_chunks: int, segment: int, have: Iterable[int] = ()):
        if segment < 1:
            raise ValueError("segment must be at least 1 chunk")
        self.num_chunks = num_chunks
        held = {i for i in have if 0 <= i < num_chunks}
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        run_start = None
        for i in range(num_chunks + 1):
            needed = i < num_chunks and i not in held
            if needed and run_start is None:
                run_start = i
            elif not needed and run_start is not None:
                self._pending.extend((a, min(a + segment, i)) for a in range(run_start, i, segment))
                run_start = None
        self._active: dict[Any, list[int]] = {}  # provider -> [next unverified chunk, end]
        self.reused = len(held)
        self.verified_count = len(held)
        self.chunks_from: collections.Counter = collections.Counter()

    @property
    def complete(self) -> bool:
        return self.verified_count == self.num_chunks

    @property
    def idle(self) -> bool:
        """Nothing left to hand out and nothing in flight: waiting for work is pointless."""
        return not self._pending and not self._active

    def take(self, provider: Any) -> tuple[int, int] | None:
        """The next segment [first, end) for ``provider``, or None if none is waiting."""
        if provider in self._active:
            raise RuntimeError("provider already has a segment in flight")
        if not self._pending:
            return None
        a, b = self._pending.popleft()
        self._active[provider] = [a, b]
        return a, b

    def verified(self, provider: Any, index: int) -> None:
        seg = self._active[provider]
        if index != seg[0]:
            raise RuntimeError(f"chunk {index} verified out of order (expected {seg[0]})")
        seg[0] += 1
        self.verified_count += 1
        self.chunks_from[provider] += 1

    def done(self, provider: Any) -> None:
        """``provider`` finished its segment (every chunk of it verified)."""
        a, b = self._active.pop(provider)
        if a != b:
            raise RuntimeError(f"segment ended with chunks {a}..{b - 1} unverified")

    def failed(self, provider: Any) -> None:
        """``provider``'s request ended early: requeue what it did not deliver."""
        seg = self._active.pop(provider, None)
        if seg is not None and seg[0] < seg[1]:
            self._pending.appendleft((seg[0], seg[1]))

    def missing(self) -> list[tuple[int, int]]:
        """Chunk ranges [first, end) not yet verified (queued or in flight), sorted."""
        return sorted(list(self._pending) + [(a, b) for a, b in self._active.values() if a < b])
