"""What a state server serves under a key: ``ChunkSource`` objects (a manifest, and its chunks on
demand). ``MemorySource`` is a snapshot in one buffer (what a trainer serves to late joiners);
others are found on demand by resolvers (e.g. the checkpoints of an on-disk store)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .manifest import Manifest


class ChunkSource(Protocol):
    """One snapshot a server can serve: its manifest, and its chunks on demand.

    ``chunk`` returns exactly chunk ``index``'s bytes (a server never re-hashes what a source
    returns; a source backed by something that can rot, like a disk, verifies them itself) and
    raises ``LookupError`` (or ``OSError``) when the chunk is no longer there.
    """

    manifest: Manifest

    async def chunk(self, index: int) -> bytes | bytearray | memoryview: ...


@dataclass(eq=False)
class MemorySource:
    """A snapshot in one buffer (from ``build_snapshot``), served without copying.

    ``on_release(buffer)``: called once the server no longer publishes the snapshot and no
    stream reads it any more, so its owner can reuse the memory;
    from then on ``acquire`` fails and a late request is told the state is no longer held.
    """

    manifest: Manifest
    buffer: torch.Tensor
    on_release: Callable[[torch.Tensor], None] | None = field(default=None, repr=False)
    view: memoryview = field(init=False, repr=False)
    _users: int = field(default=0, init=False, repr=False)
    _evicted: bool = field(default=False, init=False, repr=False)
    _released: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, torch.Tensor) or self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1 \
                or self.buffer.device.type != "cpu" or not self.buffer.is_contiguous():
            raise ValueError("buffer must be a contiguous 1-D uint8 CPU tensor (as build_snapshot returns)")
        if self.buffer.numel() != self.manifest.total_size:
            raise ValueError(f"buffer holds {self.buffer.numel()} bytes, the manifest describes "
                             f"{self.manifest.total_size}")
        self.view = memoryview(self.buffer.numpy())

    async def chunk(self, index: int) -> memoryview:
        if self._released:
            raise LookupError("the snapshot's buffer was released")
        a, b = self.manifest.chunk_span(index)
        return self.view[a:b]

    @property
    def busy(self) -> bool:
        """Whether a stream is reading it."""
        return self._users > 0

    def acquire(self) -> bool:
        """Keep the buffer for a stream that reads it; False once it was released."""
        if self._released:
            return False
        self._users += 1
        return True

    def release(self) -> None:
        self._users -= 1
        self._maybe_release()

    def evict(self) -> None:
        """No longer published: release the buffer once the streams reading it finish."""
        self._evicted = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._evicted and self._users <= 0 and not self._released:
            self._released = True
            if self.on_release is not None:
                self.on_release(self.buffer)


#: finds what to serve under a key that nothing was published for: ``await resolver(key)`` ->
#: sources, the latest first (empty when the resolver does not know the key)
Resolver = Callable[[str], Awaitable[list[ChunkSource]]]


def evict(sources: Iterable[ChunkSource]) -> None:
    """No longer published: each source that holds memory lets it go once its readers finish."""
    for s in sources:
        if callable(getattr(s, "evict", None)):
            s.evict()
