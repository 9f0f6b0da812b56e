"""AES-GCM for big frames on a small thread pool, both ways, frames still in nonce order.

Why: the event loop's one thread does every frame's work: socket copies and, inline, encryption
and decryption. ``cryptography`` 50 and later release the GIL while AES-GCM runs, so other threads
can seal frame k and open (decrypt) a received frame while the loop moves other frames and runs
the round's Python (figures: benchmarks/README.md, "Averaging").

The wire does not change. A frame's nonce is its position in the connection's order, so the nonce
is reserved on the loop when a frame is queued (sent or received), and frames move on only in
that order: ``OrderedSender`` writes a small control frame posted while a big one is being sealed
behind it, and ``OrderedReceiver`` hands a frame received after a big one still being opened to
the connection after it. Each job builds its own ``AESGCM`` for the key (see ``seal_job``).

Off below ``MIN_CPUS`` usable CPUs: with two cores the sealing thread only competes with the
loop and the other processes of a local swarm, and each hand-off costs more than it overlaps.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
from typing import Callable

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["MAX_OPENING", "MIN_CPUS", "OrderedReceiver", "OrderedSender", "Sealed", "default_threads", "make_pool",
           "seal_job", "usable_cpus"]

#: below this many usable CPUs the pool is off by default (see the module docstring)
MIN_CPUS = 4
#: received frames a connection queues behind a frame being opened on the pool before it stops
#: reading its socket: what a peer can make us hold beyond its streams' windows (``Limits``)
MAX_OPENING = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def seal_job(key: bytes, nonce: bytes, ad: bytes, plaintext, out) -> Callable[[], None]:
    """The encryption of one frame with an already reserved nonce, as a call for any thread. It
    builds its own ``AESGCM`` (about a microsecond, against ~0.2 ms for a 4 MiB frame): no cipher
    object is shared between threads, and no key outlives its connection in a cache."""
    def job() -> None:
        AESGCM(key).encrypt_into(nonce, plaintext, ad, out)
    return job


def default_threads() -> int:
    """2 where this process may run on at least ``MIN_CPUS`` CPUs, else 0 (sealing inline)."""
    return 2 if usable_cpus() >= MIN_CPUS else 0


def make_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor | None:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="seal") if threads > 0 else None


class Sealed:
    """One frame in the send queue: its length/header prefix, its ciphertext buffer, and either
    nothing left to do (``job`` None) or the future of its sealing on the pool."""

    __slots__ = ("prefix", "ciphertext", "job", "future")

    def __init__(self, prefix: bytes, ciphertext, job: Callable[[], None] | None = None):
        self.prefix, self.ciphertext, self.job = prefix, ciphertext, job
        self.future: concurrent.futures.Future | None = None

    @property
    def ready(self) -> bool:
        return self.job is None or (self.future is not None and self.future.done() and not self.future.cancelled())


class OrderedSender:
    """A connection's queue of frames waiting for an earlier frame's sealing (sans-IO about the
    socket: ``write`` is whatever hands one frame to the transport; ``fail`` closes the
    connection when a frame cannot be sealed, since its nonce would be missing from the stream)."""

    __slots__ = ("_q", "_write", "_fail", "_loop", "broken")

    def __init__(self, loop: asyncio.AbstractEventLoop, write: Callable[[bytes, object], None],
                 fail: Callable[[str], None]):
        self._q: collections.deque[Sealed] = collections.deque()
        self._write, self._fail, self._loop = write, fail, loop
        self.broken = False  # a frame could not be sealed: nothing after it may leave

    def __bool__(self) -> bool:
        return bool(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def push_ready(self, prefix: bytes, ciphertext) -> None:
        """A frame sealed inline, after frames still being sealed: it waits for them."""
        self._q.append(Sealed(prefix, ciphertext))
        self.flush()

    async def seal(self, pool: concurrent.futures.Executor, prefix: bytes, ciphertext, job: Callable[[], None]) -> None:
        """Seal a frame on ``pool`` and send it in its turn. Returns once its plaintext has been
        read (the caller may reuse it then), even if cancelled meanwhile: a frame not yet started
        is sealed here instead, one already running is waited for (under a millisecond)."""
        item = Sealed(prefix, ciphertext, job)
        item.future = fut = pool.submit(job)
        self._q.append(item)
        fut.add_done_callback(self._sealed_elsewhere)
        try:
            await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            # our caller was cancelled, or the pool shut down under the job (host closing)
            if fut.cancel():  # not started: seal it now, while the caller's buffer is still intact
                try:
                    job()
                except Exception as e:  # (a bug: the frame can never be sent)
                    self._break(f"encryption failed: {e!r}")
                    raise
                item.job = None
            else:
                concurrent.futures.wait([fut])
            self.flush()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return  # not our caller's cancellation: the frame was sealed here instead
        except Exception:
            pass  # flush() below reports it and closes the connection
        self.flush()

    def _sealed_elsewhere(self, _fut: concurrent.futures.Future) -> None:
        try:
            self._loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # the loop is closed: nobody left to send to
            pass

    def flush(self) -> None:
        """Write every frame at the head of the queue whose sealing is done."""
        q = self._q
        while q and q[0].ready and not self.broken:
            item = q.popleft()
            if item.future is not None and item.job is not None and item.future.exception() is not None:
                self._break(f"encryption failed: {item.future.exception()!r}")
                return
            self._write(item.prefix, item.ciphertext)
        # (a job the pool cancelled is not ready: the ``seal`` awaiting it seals it inline)
        if self.broken:
            q.clear()

    def _break(self, reason: str) -> None:
        self.broken = True
        self._q.clear()
        self._fail(reason)

    def clear(self) -> None:
        self._q.clear()


class OrderedReceiver:
    """A connection's received frames waiting for their own or an earlier frame's decryption on the
    pool (sans-IO about the socket): each goes to ``deliver`` in arrival (nonce) order once it and
    every frame before it are open. A frame that fails (its job raised: a bad tag) goes to ``fail``
    and nothing after it is delivered. Past ``MAX_OPENING`` queued frames ``pause(True)`` asks the
    connection to stop reading its socket, ``pause(False)`` once there is room again."""

    __slots__ = ("_q", "_deliver", "_fail", "_pause", "_loop", "_paused")

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[object], None],
                 fail: Callable[[Exception], None], pause: Callable[[bool], None]):
        self._q: collections.deque[tuple[object, concurrent.futures.Future | None, Callable[[], None] | None]] = \
            collections.deque()
        self._deliver, self._fail, self._pause, self._loop = deliver, fail, pause, loop
        self._paused = False

    def __bool__(self) -> bool:
        return bool(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def open(self, pool: concurrent.futures.Executor, frame: object, job: Callable[[], None]) -> None:
        """Run ``job`` (the decryption of ``frame``, its nonce taken) on ``pool``; deliver in turn."""
        fut = pool.submit(job)
        self._q.append((frame, fut, job))
        fut.add_done_callback(self._opened_elsewhere)
        self._check_room()

    def push(self, frame: object) -> None:
        """A frame opened inline, received after frames still being opened: it waits for them."""
        self._q.append((frame, None, None))
        self._check_room()

    def _check_room(self) -> None:
        if not self._paused and len(self._q) >= MAX_OPENING:
            self._paused = True
            self._pause(True)

    def _opened_elsewhere(self, _fut: concurrent.futures.Future) -> None:
        try:
            self._loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # the loop is closed: nobody left to deliver to
            pass

    def flush(self) -> None:
        """Deliver every frame at the head of the queue that is open."""
        q = self._q
        while q:
            frame, fut, job = q[0]
            if fut is not None:
                if not fut.done():
                    break
                if fut.cancelled():  # the pool shut down under it (host closing): open it here
                    fut = None
                    try:
                        job()  # type: ignore[misc]
                    except Exception as e:
                        self._failed(e)
                        return
                elif fut.exception() is not None:
                    self._failed(fut.exception())  # type: ignore[arg-type]
                    return
            q.popleft()
            self._deliver(frame)  # (may close the connection, which clears the queue)
        if self._paused and len(q) < MAX_OPENING:
            self._paused = False
            self._pause(False)

    def _failed(self, error: Exception) -> None:
        self.clear()
        self._fail(error)

    def clear(self) -> None:
        """Drop every queued frame; those whose decryption has not started never run."""
        for _frame, fut, _job in self._q:
            if fut is not None:
                fut.cancel()
        self._q.clear()
