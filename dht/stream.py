"""Bulk byte streams multiplexed on a peer connection, with credit-based flow control.

RPC bodies go through msgpack; tensors and checkpoint chunks must not. A ``Stream`` carries raw
buffers in frames of up to 4 MiB (``wire.MAX_FRAME_BODY``, or less if the peer says so), and each
direction has a receive window (like yamux/HTTP2): the sender may have at most ``window`` unread
bytes outstanding, so a slow consumer bounds the memory a fast producer can make it hold, per
stream, instead of growing an unbounded queue.

The window counts bytes, and a frame costs more than its bytes: frames under ``COALESCE_BELOW``
are therefore copied together into one buffer while they wait to be read, so a peer sending
1-byte frames makes us hold its bytes, not an object per frame (an 8 MiB window of them held
~2.4 GB), and empty data frames are refused. Bigger frames stay zero-copy views.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from typing import TYPE_CHECKING, Any, AsyncIterator

from .aio import wait_event
from .errors import PeerUnreachable, ProtocolError, RPCTimeout
from .wire import HEADER_SIZE, TAG_SIZE, Kind

if TYPE_CHECKING:
    from .identity import PeerID
    from .connection import Connection

WINDOW_BODY = struct.Struct(">I")
#: a stream's receive window where ``Limits.stream_window`` is not set (see there for the measurements)
DEFAULT_STREAM_WINDOW = 8 << 20
#: ... on hosts that seal big frames on threads (4 or more usable CPUs)
WIDE_STREAM_WINDOW = 32 << 20
#: received frames smaller than this wait in a shared buffer, not each in its own objects: a
#: stream then queues at most 2 * window / COALESCE_BELOW + 1 chunks (see ``Limits``)
COALESCE_BELOW = 64 << 10
#: what one queued chunk costs beyond its buffer (its memoryview and deque slot), for accounting
CHUNK_OVERHEAD = 256
#: what a received frame's buffer holds beyond its data: the frame's header and auth tag
FRAME_OVERHEAD = HEADER_SIZE + TAG_SIZE


class StreamReset(PeerUnreachable):
    """The stream was reset by the remote side or its connection died."""


class Stream:
    """One bidirectional byte stream. Write with ``write``/``write_eof``, read with ``read`` or
    ``async for chunk in stream``; chunks are memoryviews the consumer may keep."""

    def __init__(
        self, conn: Connection, ident: int, protocol: str, header: Any, window: int, send_window: int | None = None
    ):
        # ``window``: what we accept unread; ``send_window``: what the remote accepts (its window).
        self._conn = conn
        self.id = ident
        self.protocol = protocol
        self.header = header
        self._window = window
        self._send_credit = window if send_window is None else send_window
        self._send_window = self._send_credit
        self._credit_event = asyncio.Event()
        self._chunks: collections.deque[memoryview | bytearray] = collections.deque()
        self._tail: bytearray | None = None  # the last queued chunk, while small frames still join it
        self._buffered = 0  # bytes received and not yet read
        self._held = 0  # memory they hold: their buffers and CHUNK_OVERHEAD per chunk
        self._keep_received = False  # reset by the peer after its end: what it sent stays readable
        self._unacked = 0  # bytes read but not yet returned to the sender as credit
        self._data_event = asyncio.Event()
        self._eof_received = False
        self._eof_sent = False
        self._reset_reason: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def peer_id(self) -> PeerID:
        return self._conn.remote_peer

    @property
    def closed(self) -> bool:
        return self._reset_reason is not None or (self._eof_received and self._eof_sent)

    @property
    def queued_bytes(self) -> int:
        """Bytes received and not read yet (at most the window)."""
        return self._buffered

    @property
    def queued_chunks(self) -> int:
        return len(self._chunks)

    @property
    def held_bytes(self) -> int:
        """Memory the unread bytes hold: their buffers (a big frame's pooled buffer may be up to
        twice its frame) and ``CHUNK_OVERHEAD`` per chunk."""
        return self._held

    # ------------------------------------------------------------------ writing

    async def write(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Send ``data`` (any contiguous buffer) without copying it through msgpack.

        Waits for flow-control credit and for the socket to drain; ``timeout`` bounds each wait.
        """
        view = memoryview(data).cast("B")
        while view:
            self._check_writable()
            n = min(len(view), self._conn.max_data_body)
            # Wait for credit for the whole frame rather than split it: a reader that wants
            # frame-sized pieces then gets each as one zero-copy view. That cannot deadlock while
            # n <= window/2: a reader that has read everything sent owes less than window/2
            # (it returns credit at every window/2 it reads), so the credit comes back.
            if self._send_credit <= 0 or (self._send_credit < n <= self._send_window // 2):
                self._credit_event.clear()
                await self._wait(self._credit_event, timeout, "flow-control credit")
                continue
            n = min(n, self._send_credit)
            self._send_credit -= n
            await self._conn.send_bulk(Kind.STREAM_DATA, self.id, view[:n])
            self.bytes_sent += n
            view = view[n:]
            await self._conn.drain(timeout)

    def write_eof(self) -> None:
        """Tell the remote side no more data follows (it sees the end of its reads)."""
        if not self._eof_sent and self._reset_reason is None:
            self._eof_sent = True
            self._conn.post(Kind.STREAM_END, self.id)
            self._maybe_forget()

    def reset(self, reason: str = "reset") -> None:
        """Abort both directions; the remote side's pending reads and writes fail with ``reason``."""
        if self._reset_reason is None:
            self._conn.post(Kind.STREAM_RESET, self.id, self._conn.pack(reason[:200]))
            self._on_reset(f"reset locally: {reason}")
        elif self._keep_received:  # the peer reset first, after its end: drop what it left us too
            self._keep_received = False
            self._drop_queued()

    def _check_writable(self) -> None:
        if self._reset_reason is not None:
            raise StreamReset(f"stream {self.protocol!r} to {self.peer_id}: {self._reset_reason}")
        if self._eof_sent:
            raise ProtocolError("write after write_eof")

    # ------------------------------------------------------------------ reading

    async def read(self, timeout: float | None = None) -> memoryview | None:
        """Next chunk, or None at the end of the stream. Raises StreamReset if the stream died."""
        while not self._chunks:
            if self._reset_reason is not None and not self._keep_received:
                raise StreamReset(f"stream {self.protocol!r} from {self.peer_id}: {self._reset_reason}")
            if self._eof_received:
                self._maybe_forget()
                return None
            self._data_event.clear()
            await self._wait(self._data_event, timeout, "data")
        chunk = self._chunks.popleft()
        self._held -= _cost(chunk)
        if chunk is self._tail:
            self._tail = None
        if type(chunk) is bytearray:
            chunk = memoryview(chunk)
        self._buffered -= len(chunk)
        if not self._chunks and self._eof_received:
            self._maybe_forget()
        self._unacked += len(chunk)
        if self._unacked >= self._window // 2 and self._reset_reason is None:
            self._conn.post(Kind.WINDOW, self.id, WINDOW_BODY.pack(self._unacked))
            self._unacked = 0
        return chunk

    async def read_all(self, max_size: int, timeout: float | None = None) -> bytearray:
        """Read to the end into one buffer, refusing more than ``max_size`` bytes."""
        out = bytearray()
        while (chunk := await self.read(timeout)) is not None:
            if len(out) + len(chunk) > max_size:
                self.reset("too much data")
                raise ProtocolError(f"stream sent more than {max_size} bytes")
            out += chunk
        return out

    async def readinto(self, buffer: memoryview, timeout: float | None = None) -> int:
        """Fill ``buffer`` from the stream (e.g. a tensor's memory); returns bytes written."""
        buffer = buffer.cast("B")
        filled = 0
        while filled < len(buffer):
            chunk = await self.read(timeout)
            if chunk is None:
                break
            if filled + len(chunk) > len(buffer):
                self.reset("too much data")
                raise ProtocolError("stream sent more data than the receiving buffer holds")
            buffer[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return filled

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        while (chunk := await self.read()) is not None:
            yield chunk

    async def _wait(self, event: asyncio.Event, timeout: float | None, what: str) -> None:
        if not await wait_event(event, timeout):
            raise RPCTimeout(f"stream {self.protocol!r} with {self.peer_id}: no {what} within {timeout} s")

    # ------------------------------------------------------------------ called by the connection

    def _on_data(self, chunk: memoryview) -> None:
        n = len(chunk)
        if self._eof_received:
            raise ProtocolError("stream data after end")
        if self._buffered + self._unacked + n > self._window:
            raise ProtocolError("peer overran the stream's flow-control window")
        if n < COALESCE_BELOW:
            tail = self._tail
            if tail is None or len(tail) >= COALESCE_BELOW:
                tail = self._tail = bytearray()
                self._chunks.append(tail)
                self._held += CHUNK_OVERHEAD
            tail += chunk
            self._held += n
        else:
            self._tail = None
            self._chunks.append(chunk)
            self._held += _cost(chunk)
        self._buffered += n
        self.bytes_received += n
        self._data_event.set()

    def _on_window(self, credit: int) -> None:
        self._send_credit += credit
        self._credit_event.set()

    def _on_eof(self) -> None:
        self._eof_received = True
        self._data_event.set()
        self._maybe_forget()

    def _on_reset(self, reason: str, keep_received: bool = False) -> None:
        """Both directions are dead. ``keep_received`` (a reset by the peer on a stream we
        opened): when the peer had ended its side, what it sent stays readable, then the end."""
        if self._reset_reason is None:
            self._reset_reason = reason
            self._keep_received = keep_received and self._eof_received
            if not self._keep_received:
                self._drop_queued()
        self._data_event.set()
        self._credit_event.set()
        self._conn.forget_stream(self.id)

    def _drop_queued(self) -> None:
        self._chunks.clear()
        self._tail = None
        self._held = self._buffered = 0

    def _maybe_forget(self) -> None:
        # only once drained: until then what it queued counts against its connection's streams
        if self._eof_received and self._eof_sent and not self._chunks:
            self._conn.forget_stream(self.id)


def held_bound(window: int) -> int:
    """The most a stream with receive ``window`` holds for unread data: each queued frame's buffer
    is at most twice its frame, i.e. its bytes and ``FRAME_OVERHEAD`` (see ``Connection``), and the
    chunks are at most 2 * window / COALESCE_BELOW + 1 (every chunk but the last holds
    COALESCE_BELOW bytes or more, or sits next to one that does)."""
    return 2 * window + (2 * window // COALESCE_BELOW + 1) * (CHUNK_OVERHEAD + 2 * FRAME_OVERHEAD)


def _cost(chunk: memoryview | bytearray) -> int:
    """What a queued chunk holds: the whole buffer it views (a pooled frame buffer), or its own."""
    buf = chunk.obj if type(chunk) is memoryview else chunk
    return len(buf) + CHUNK_OVERHEAD  # type: ignore[arg-type]
