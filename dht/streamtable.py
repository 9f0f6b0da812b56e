"""One connection's streams (``StreamTable``): opening ours, admitting the peer's, serving them, routing frames.

Kept apart from ``connection`` so that what a peer's streams may make us hold is enforced in one
place (the bound itself is stated in ``Limits``): streams the peer opens are capped per connection
and, by their windows, per host; a peer that keeps opening past the caps is disconnected; and a
stream whose handler returned is reset unless the peer has ended its side, since nothing reads it
any more (such a stream kept queueing whatever the peer sent, and kept its connection "busy", so
that the idle timeout never closed it).
"""

from __future__ import annotations

import logging
import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from .errors import DHTError, ProtocolError
from .stream import WINDOW_BODY, Stream
from .wire import MAX_STREAM_HEADER, Kind, pack, unpack

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("dht.transport")

StreamHandler = Callable[[Stream], Awaitable[None]]

#: the reset reason an opener sees when it goes on writing after the handler returned
HANDLER_DONE = "the handler returned"


class StreamTable:
    """One connection's open streams, by id, and the ids of those the peer opened."""

    __slots__ = ("_conn", "_streams", "_inbound", "refused")

    def __init__(self, conn: Connection):
        self._conn = conn
        self._streams: dict[int, Stream] = {}
        self._inbound: set[int] = set()  # ids of the streams the remote side opened
        self.refused = 0  # its stream opens we refused for capacity (see Limits)

    def __contains__(self, ident: int) -> bool:
        return ident in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(list(self._streams.values()))

    @property
    def queued_bytes(self) -> int:
        """Bytes received on this connection's streams and not read yet."""
        return sum(s.queued_bytes for s in self._streams.values())

    @property
    def held_bytes(self) -> int:
        """Memory those bytes hold (buffers and per-chunk objects): what ``Limits`` bounds."""
        return sum(s.held_bytes for s in self._streams.values())

    @property
    def queued_chunks(self) -> int:
        return sum(s.queued_chunks for s in self._streams.values())

    # ------------------------------------------------------------------ ours

    def add(self, ident: int, protocol: str, header: Any) -> Stream:
        """A stream that accepts our window and sends within the remote's announced one."""
        conn = self._conn
        stream = Stream(conn, ident, protocol, header, conn.host.stream_window, conn.remote_window)
        self._streams[ident] = stream
        return stream

    def forget(self, ident: int) -> None:
        self._streams.pop(ident, None)
        if ident in self._inbound:
            self._inbound.discard(ident)
            self._conn.host.inbound_stream_memory -= self._conn.host.stream_window

    def reset_all(self, reason: str) -> None:
        """The connection died: every stream's pending reads and writes fail with ``reason``."""
        for stream in list(self._streams.values()):
            stream._on_reset(reason)

    # ------------------------------------------------------------------ the peer's

    def open_inbound(self, ident: int, body: memoryview) -> None:
        """The peer opened stream ``ident``: serve it with the protocol's handler, or reset it
        with the reason (unknown protocol, or over a cap)."""
        conn = self._conn
        if ident in self._streams or (ident % 2 == 1) != (not conn.initiator):
            raise ProtocolError("bad stream id")
        if len(body) > MAX_STREAM_HEADER:  # the header is held as long as the stream is open
            raise ProtocolError(f"stream open of {len(body)} bytes exceeds the {MAX_STREAM_HEADER}-byte limit")
        msg = unpack(body)
        if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], str)):
            raise ProtocolError("malformed stream open")
        protocol, header = msg
        host, limits = conn.host, conn.host.limits
        handler = host._stream_handlers.get(protocol)
        reason = None
        if handler is None:
            reason = f"unknown protocol {protocol!r}"
        elif len(self._streams) >= limits.max_streams or len(self._inbound) >= limits.max_inbound_streams:
            reason = "too many streams"
        elif host.inbound_stream_memory + host.stream_window > host.inbound_stream_cap:
            reason = "busy: too many incoming streams on this host; retry later"
            host.log_refusal(conn.remote_host, conn.remote_port,
                             f"stream {protocol!r} from {conn.remote_peer}: {reason}")
        if reason is not None:
            conn.post(Kind.STREAM_RESET, ident, pack(reason))
            if handler is not None:
                self.refused += 1
                if self.refused > limits.max_refused_streams:
                    host.log_refusal(conn.remote_host, conn.remote_port,
                                     f"{conn.remote_peer}: kept opening streams past our limits; disconnected")
                    conn.close(f"opened {self.refused} streams past our limits", abort=True)
            return
        stream = self.add(ident, protocol, header)
        self._inbound.add(ident)
        host.inbound_stream_memory += host.stream_window
        conn._spawn(self._serve(stream, handler))

    async def _serve(self, stream: Stream, handler: StreamHandler) -> None:
        try:
            await handler(stream)
            stream.write_eof()
            if stream.id in self._streams:  # not ended and read to its end: nobody here reads it now
                stream.reset(HANDLER_DONE)
        except asyncio.CancelledError:
            stream.reset("cancelled")
        except DHTError as e:
            stream.reset(str(e)[:200])
        except Exception:
            log.exception("stream handler %s failed", stream.protocol)
            stream.reset("internal error")

    # ------------------------------------------------------------------ frames

    def on_frame(self, kind: int, ident: int, view: memoryview) -> None:
        """A data, end, window or reset frame for stream ``ident`` (decrypted)."""
        stream = self._streams.get(ident)
        if stream is None:
            return  # late frames of a stream we already closed: harmless
        if kind == Kind.STREAM_DATA:
            stream._on_data(view)
        elif kind == Kind.STREAM_END:
            stream._on_eof()
        elif kind == Kind.WINDOW:
            if len(view) != WINDOW_BODY.size:
                raise ProtocolError("malformed window update")
            stream._on_window(WINDOW_BODY.unpack(view)[0])
        elif kind == Kind.STREAM_RESET:
            reason = unpack(view) if view else "reset"
            # A reset after the peer ended its output (a handler that returned) leaves what it sent
            # readable on a stream we opened: the reply was complete. Ours to read, so not the
            # peer's to make us hold: on a stream the peer opened, the data goes with the reset.
            stream._on_reset(f"reset by peer: {reason if isinstance(reason, str) else 'reset'}",
                             keep_received=ident not in self._inbound)
