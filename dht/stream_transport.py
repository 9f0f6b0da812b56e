"""An ``asyncio.Transport`` over a ``Stream``: lets a ``Connection`` run on top of another connection.

Why: a peer behind a NAT is reached through a relay (``dht.relay``), which forwards the bytes of
one stream on the dialer's connection to one stream on the target's. Running the ordinary
``transport.Connection`` (Noise XX handshake, frames, RPC, streams) over that byte pipe makes the
circuit end-to-end secure without a second implementation of any of it: the relay only sees
ciphertext, and the handshake's ``expected_peer`` check means it cannot stand in for either end.

Only the part of the transport API that ``Connection`` uses is implemented: ``write``,
``writelines``, ``is_closing``, ``close``, ``abort``, ``get_extra_info``,
``set_write_buffer_limits`` and ``get_write_buffer_size``; inbound bytes go to the protocol through
``get_buffer``/``buffer_updated`` like a socket's, and ``pause_writing``/``resume_writing`` tell it
when the stream below is not keeping up (its flow-control credit, the relay's pace), so a fast
writer above is held back instead of queueing without bound.

The transport does nothing until :meth:`StreamTransport.run` is awaited: that coroutine is its
whole life (it calls ``connection_made``, feeds the protocol, owns the writer task, and ends with
``connection_lost``), so whoever runs it owns every task involved and can cancel it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from .errors import DHTError
from .stream import Stream, StreamReset

#: writes smaller than this are copied together into one stream write (one frame, not many)
COALESCE_BELOW = 64 * 1024
#: after a graceful close, how long to wait for the remote end to close its side before a reset
CLOSE_TIMEOUT = 5.0


class StreamTransport(asyncio.Transport):
    """Carries a ``BufferedProtocol``'s bytes over ``stream``; ``leftover`` is delivered first
    (bytes that arrived in the same chunk as the relay's status line)."""

    def __init__(self, stream: Stream, protocol: asyncio.BufferedProtocol, *, extra: dict[str, Any] | None = None,
                 leftover: bytes = b"", close_timeout: float = CLOSE_TIMEOUT):
        # A stream carries no socket and no IP address: peername None keeps the DHT from taking the
        # relay's address for the remote peer's.
        super().__init__({"peername": None, "socket": None, "sockname": None, **(extra or {})})
        self._stream = stream
        self._protocol = protocol
        self._leftover = leftover
        self._close_timeout = close_timeout
        self._out: collections.deque[bytes | bytearray | memoryview] = collections.deque()
        self._out_size = 0
        self._high = 64 * 1024
        self._low = 16 * 1024
        self._paused = False
        self._closing = False  # close() or abort() called: no more writes accepted, none delivered
        self._aborted = False
        self._lost = False
        self._wake = asyncio.Event()

    @property
    def stream(self) -> Stream:
        return self._stream

    # ------------------------------------------------------------------ the transport's life

    async def run(self) -> None:
        """Connect the protocol, pump the stream into it until either side ends, then tell it.

        Cancelling this (e.g. because the connection under the stream closed) resets the stream
        and ends the protocol's connection."""
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self._write_loop())
        exc: Exception | None = None
        try:
            self._protocol.connection_made(self)
            if self._leftover:
                self._deliver(self._leftover)
                self._leftover = b""
            while True:
                chunk = await self._stream.read()
                if chunk is None:  # the remote end closed its side
                    break
                if not self._closing:
                    self._deliver(chunk)
                # else: we closed; what still arrives has no reader, we only wait for the remote's end
        except StreamReset as e:
            exc = e
        except DHTError as e:  # e.g. a stream that misbehaves under us: end this connection, not the loop
            exc = e
            self._stream.reset(str(e)[:200])
        except asyncio.CancelledError:
            exc = ConnectionAbortedError("the connection under the relayed stream closed")
            self._stream.reset("cancelled")
            raise
        finally:
            writer.cancel()
            self._closing = True
            self._out.clear()
            self._out_size = 0
            if not self._stream.closed:  # the remote ended (EOF): end our side too
                self._stream.write_eof()
            self._connection_lost(exc)
            try:
                await writer
            except asyncio.CancelledError:
                # ours, or the writer's own: either way the writer is done; re-raise only ours
                t = asyncio.current_task()
                if t is not None and t.cancelling():
                    raise

    def _connection_lost(self, exc: Exception | None) -> None:
        if not self._lost:
            self._lost = True
            self._protocol.connection_lost(exc)

    def _deliver(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` into the protocol's buffers, as a socket's reads would."""
        view = memoryview(data).cast("B")
        while view and not self._closing:
            buf = self._protocol.get_buffer(len(view))
            n = min(len(buf), len(view))
            if n == 0:
                raise RuntimeError("protocol offered an empty buffer")
            buf[:n] = view[:n]
            view = view[n:]
            self._protocol.buffer_updated(n)

    async def _write_loop(self) -> None:
        """Hand queued writes to the stream, at the pace its flow control allows."""
        stream = self._stream
        try:
            while True:
                while not self._out:
                    if self._closing:
                        if not self._aborted:
                            await self._finish()
                        return
                    self._wake.clear()
                    await self._wake.wait()
                data, size = self._next_chunk()
                await stream.write(data)
                self._out_size -= size
                if self._paused and self._out_size <= self._low:
                    self._paused = False
                    self._protocol.resume_writing()
        except DHTError as e:  # the stream died: the reader sees it too and ends the connection
            if not self._stream.closed:
                self._stream.reset(str(e)[:200])

    def _next_chunk(self) -> tuple[bytes | bytearray | memoryview, int]:
        """The next piece to write: a big buffer as it is (no copy), small ones joined together."""
        first = self._out.popleft()
        size = len(first) if not isinstance(first, memoryview) else first.nbytes
        if size >= COALESCE_BELOW or not self._out:
            return first, size
        joined = bytearray(first)
        while self._out and len(joined) < COALESCE_BELOW:
            nxt = self._out[0]
            if (len(nxt) if not isinstance(nxt, memoryview) else nxt.nbytes) >= COALESCE_BELOW:
                break
            joined += self._out.popleft()
        return joined, len(joined)

    async def _finish(self) -> None:
        """After a graceful close: end our side, give the remote end a moment to end its side
        (the reader then returns), and reset the stream if it does not."""
        self._stream.write_eof()
        await asyncio.sleep(self._close_timeout)
        self._stream.reset("closed")

    # ------------------------------------------------------------------ asyncio.Transport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return  # like a socket transport after close: nothing more goes out
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        if not size:
            return
        # Kept by reference, not copied: a pooled buffer stays out of reuse while it is queued here.
        self._out.append(data)
        self._out_size += size
        self._wake.set()
        if not self._paused and self._out_size > self._high:
            self._paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Send what is queued, then end the stream; ``connection_lost`` follows."""
        if not self._closing:
            self._closing = True
            self._wake.set()

    def abort(self) -> None:
        """Drop what is queued and reset the stream at once."""
        if not self._aborted:
            self._closing = self._aborted = True
            self._out.clear()
            self._out_size = 0
            self._wake.set()
            self._stream.reset("connection aborted")

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = 64 * 1024 if high is None else high
        self._low = self._high // 4 if low is None else low

    def get_write_buffer_size(self) -> int:
        return self._out_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def is_reading(self) -> bool:
        return not self._closing

    def pause_reading(self) -> None:  # flow control already lives in the stream's window
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment]

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol
