"""Host byte buffers for state snapshots and downloads, kept and touched ahead of need.

Why: the first write to fresh memory takes a page fault every 4 KiB, and on the virtual machines
peers run on, with other processes busy, those faults cost far more than the copy itself (a
provider answering a joiner spent most of its snapshot time in them). So a peer touches its snapshot
buffers ahead of time, in a background thread at low priority, once its state has its full size,
and reuses the buffer of a snapshot it no longer serves (``optim.state_sync``: two buffers take
turns). A joiner's download buffer is not touched ahead: a warm-up of it ran beside the download
it was meant to speed up and made it slower.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["Recycler", "available_memory"]


def available_memory() -> int | None:
    """Bytes the kernel says new allocations can take without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _lowest_priority() -> None:
    """Run the calling thread at nice 19 where threads have their own priority (Linux)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _fits(size: int, nbytes: int) -> bool:
    """A buffer of ``size`` bytes serves ``nbytes``, without pinning more than twice that."""
    return nbytes <= size <= 2 * max(nbytes, 1)


class Recycler:
    """Hands out contiguous 1-D uint8 CPU buffers, reusing the ones given back.

    ``take(n)`` returns a view of exactly ``n`` bytes: of a spare of at least ``n`` (and at most
    twice ``n``, so a small request never pins a big buffer), else of a fresh allocation.
    ``give(buffer)`` returns one whose contents nobody reads any more; at most ``keep`` spares
    are held, the largest kept. ``warm(n)`` allocates and touches a spare in a background
    thread; ``wait()`` before ``take`` uses it rather than faulting a second buffer beside it.
    ``max_fraction``: warm only when ``n`` is at most this share of the memory available (a
    spare costs a whole state's worth of RAM).

    Thread-safe: snapshots are built in executor threads, buffers come back on the event loop.
    """

    def __init__(self, keep: int = 1, max_fraction: float = 1 / 8):
        self.keep = keep
        self.max_fraction = max_fraction
        self._spares: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._warming: tuple[int, threading.Event] | None = None
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.reused = 0  # takes served from a spare (for tests and benchmarks)
        self.fresh = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of a spare, or of a fresh buffer (never waits: it may run under a lock)."""
        with self._lock:
            fits = [b for b in self._spares if _fits(b.numel(), nbytes)]
            if fits:
                best = min(fits, key=torch.Tensor.numel)
                self._spares.remove(best)
                self.reused += 1
                return best[:nbytes]
        self.fresh += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the warm-up under way, if any."""
        with self._lock:
            warming = self._warming
        if warming is not None:
            warming[1].wait(timeout)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (a view from ``take`` or any 1-D uint8 CPU tensor) for a later take."""
        base = buffer._base if buffer._base is not None else buffer
        if self._closed or base.dtype != torch.uint8 or base.dim() != 1 or base.device.type != "cpu":
            return
        with self._lock:
            if any(b.data_ptr() == base.data_ptr() for b in self._spares):
                return
            self._spares.append(base)
            self._spares.sort(key=torch.Tensor.numel, reverse=True)
            del self._spares[self.keep :]

    def holds(self, nbytes: int, count: int = 1) -> bool:
        """Whether ``count`` takes of ``nbytes`` would be served by spares (or a warm-up under way)."""
        with self._lock:
            w = self._warming
            if w is not None and _fits(w[0], nbytes):
                return True
            return self._count(nbytes) >= count

    def _count(self, nbytes: int) -> int:
        return sum(1 for b in self._spares if _fits(b.numel(), nbytes))

    def trim(self, keep: int) -> None:
        """Hold at most ``keep`` spares from now on (the smallest go)."""
        with self._lock:
            self.keep = keep
            del self._spares[keep:]

    def warm(self, nbytes: int, count: int = 1) -> bool:
        """Touch spares of ``nbytes`` in a background thread until ``count`` are held, unless
        a warm-up is under way or memory is short. Returns whether a warm-up started."""
        if nbytes <= 0 or self._closed or self.holds(nbytes, count):
            return False
        free = available_memory()
        if free is not None and nbytes * count > free * self.max_fraction:
            return False
        done = threading.Event()
        with self._lock:
            if self._warming is not None:
                return False
            self._warming = (nbytes, done)
            missing = count - self._count(nbytes)
            self.keep = max(self.keep, count)

        def run() -> None:
            try:
                _lowest_priority()  # spare CPU only: a download or a round may be running now
                for _ in range(missing):
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                    buf.zero_()  # the faults happen here, not in a snapshot that someone waits for
                    self.give(buf)
            finally:
                with self._lock:
                    self._warming = None
                done.set()
                self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name="p2ptrain-warm-buffer", daemon=True)
        self._threads.add(t)
        t.start()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Drop the spares and wait (bounded) for a warm-up under way."""
        self._closed = True
        for t in list(self._threads):
            t.join(timeout)
        with self._lock:
            self._spares.clear()
