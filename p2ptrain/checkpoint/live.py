"""Serve a trainer's state from its live tensors: no copy of the state while nobody changes it.

A ``LiveSource`` describes one version of the state (the manifest is hashed from the live
tensors, a chunk at a time) and reads each chunk from them when a peer asks, under the trainer's
lock, as long as the version is unchanged. When the trainer is about to change the state (it takes
the lock: ``preserve``) while a peer downloads that version (a stream reads it, or a peer got its
manifest or a chunk within ``LEASE`` seconds: the gaps between a fetcher's segment requests), the
source copies the whole version into one buffer first and serves the rest from it; the copy goes
once no stream reads it and the lease ran out. So a peer holds no state copy at all while nobody
downloads, and one per version whose download straddles an update, however long it takes.
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import P2PTrainError
from ..gil import short_gil_waits
from .manifest import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_TOTAL, Manifest, StateTooLarge, hash_pieces, layout
from .tree import flatten, tensor_specs

#: seconds a manifest or chunk handed out keeps its version readable across updates (a fetcher's
#: next chunk request follows within round trips; a lease longer than that only holds memory)
LEASE = 10.0


class StateMoved(P2PTrainError, LookupError):
    """The version a source describes changed and was not preserved."""


class LiveSource:
    """One version of a trainer's state, read from its live tensors (see the module docstring).

    ``state`` and ``version`` are read with ``lock`` held (the raw lock: not the trainer's hook);
    ``version()`` changes whenever the state does."""

    def __init__(self, lock: threading.Lock, state: Callable[[], Any], version: Callable[[], Any],
                 chunk_size: int = DEFAULT_CHUNK_SIZE, max_total: int = DEFAULT_MAX_TOTAL):
        self._lock = lock
        self._version_now = version
        with lock:
            skeleton, tensors = flatten(state())
            self.version = version()
        entries, total = layout(tensor_specs(skeleton))
        if total > max_total:
            raise StateTooLarge(total, max_total)
        self.skeleton, self.entries, self.total = skeleton, entries, total
        self.chunk_size, self.max_total = chunk_size, max_total
        self._bytes = [_as_bytes(t) if e.nbytes else None for t, e in zip(tensors, entries)]
        self._starts = [e.offset for e in entries]
        self._copy: torch.Tensor | None = None  # the preserved version, once the state changed
        self._gone = False
        self._users = 0  # streams reading (event loop) and the hashing (a worker thread)
        self._users_lock = threading.Lock()
        self._leased_until = 0.0
        self.manifest: Manifest | None = None

    # ------------------------------------------------------------------ describing

    def describe(self, meta: dict) -> Manifest:
        """Hash every chunk (reading the live tensors) into this version's manifest."""
        n = -(-self.total // self.chunk_size)
        scratch = threading.local()  # one chunk buffer per hashing thread

        def piece(i: int) -> Any:
            a = i * self.chunk_size
            b = min(self.total, a + self.chunk_size)
            if getattr(scratch, "buf", None) is None:
                scratch.buf = _mapped(self.chunk_size)
            return self.read(a, b, scratch.buf[: b - a]).numpy()

        self.acquire()  # an update while we hash preserves the version instead of changing it under us
        try:
            with short_gil_waits():
                digests = hash_pieces(n, piece)
        finally:
            self.release()
        self.manifest = Manifest(self.skeleton, tuple(self.entries), self.chunk_size, digests, dict(meta),
                                 self.max_total)
        return self.manifest

    # ------------------------------------------------------------------ reading

    def read(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes ``a:b`` of this version (uint8, CPU; read into ``out`` when it is read live);
        StateMoved once it changed unpreserved."""
        with self._lock:
            if self._copy is not None:
                data = self._copy[a:b]
            elif self._gone or self._version_now() != self.version:
                self._gone = True
                raise StateMoved("the state moved on since its manifest")
            else:
                data = self._read_live(a, b, out)
        self.lease()  # the reader's next request keeps the version, whatever changes meanwhile
        return data

    def _read_live(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(b - a, dtype=torch.uint8) if out is None else out
        done = a  # bytes before it are written; gaps (alignment padding) are zeros
        i = max(0, bisect.bisect_right(self._starts, a) - 1)
        while i < len(self.entries) and self.entries[i].offset < b:
            e, src = self.entries[i], self._bytes[i]
            lo, hi = max(a, e.offset), min(b, e.offset + e.nbytes)
            if src is not None and lo < hi:
                out[done - a : lo - a].zero_()
                out[lo - a : hi - a].copy_(src[lo - e.offset : hi - e.offset])
                done = hi
            i += 1
        out[done - a :].zero_()
        return out

    async def chunk(self, index: int) -> memoryview:
        assert self.manifest is not None
        a, b = self.manifest.chunk_span(index)
        data = await asyncio.get_running_loop().run_in_executor(None, self.read, a, b)
        return memoryview(data.numpy())

    # ------------------------------------------------------------------ lifetime

    @property
    def busy(self) -> bool:
        """Whether a peer reads this version or holds a lease on it (it is kept across updates)."""
        return self.readable and (self._users > 0 or time.monotonic() < self._leased_until)

    def acquire(self) -> bool:
        """Count a reader (a stream, or the hashing); False once the version is gone."""
        with self._users_lock:
            if not self.readable:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._users_lock:
            self._users -= 1

    def lease(self, seconds: float | None = None) -> None:
        """Keep the version readable across updates for ``seconds`` (default ``LEASE``: a peer has
        its manifest)."""
        self._leased_until = max(self._leased_until, time.monotonic() + (LEASE if seconds is None else seconds))

    def evict(self) -> None:
        """No longer served: drop the copy, if any, once nothing reads it."""
        self._leased_until = 0.0
        self.expire()

    def preserve(self) -> None:
        """Called with the lock held, before the state changes: copy this version if a peer reads
        it or holds a lease on it; else let it go."""
        if self._copy is not None or self._gone:
            return
        if self._version_now() != self.version:
            self._gone = True
        elif self.busy:
            self._copy = self._read_live(0, self.total)
            self._bytes = []  # (the live tensors are not ours to keep alive)
        else:
            self._gone = True

    def expire(self) -> None:
        """Drop the preserved copy once nothing reads it and its lease ran out."""
        if self._copy is not None and not self.busy:
            self._copy = None
            self._gone = True

    @property
    def readable(self) -> bool:
        """Whether this version can still be read: from its copy, or live while unchanged (read
        outside the lock, a hint: ``read`` decides)."""
        return self._copy is not None or (not self._gone and self._version_now() == self.version)

    @property
    def held_bytes(self) -> int:
        """Bytes of the preserved copy (0 while served live)."""
        return self._copy.numel() if self._copy is not None else 0


def _mapped(n: int) -> torch.Tensor:
    """``n`` bytes of fresh anonymous memory, unmapped when the tensor goes: chunk-sized buffers
    malloc'd on short-lived hashing threads stay in their arenas (its mmap threshold rises past them)."""
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor: a view of a contiguous tensor (any device)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # (a copy, made once per version)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class StateLock:
    """A trainer's state lock whose every acquisition first runs ``before_change`` (lock held),
    which preserves the versions peers are downloading (``LiveSource.preserve``). Readers of the state
    that change nothing take ``raw``, the plain lock underneath."""

    def __init__(self) -> None:
        self.raw = threading.Lock()
        self.before_change: Callable[[], None] | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self.raw.acquire(blocking, timeout):
            return False
        if self.before_change is not None:
            try:
                self.before_change()
            except BaseException:
                self.raw.release()
                raise
        return True

    def release(self) -> None:
        self.raw.release()

    def locked(self) -> bool:
        return self.raw.locked()

    def __enter__(self) -> StateLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
