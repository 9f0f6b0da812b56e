"""Authenticated, encrypted connections between peers, with multiplexed RPC and bulk streams.

``Host`` owns a listening socket (unless in client mode), one ``Connection`` per remote peer, and
every task that serves them. A connection is an asyncio ``BufferedProtocol``: bytes land in the
``FrameReader``'s buffers (a big frame straight into a buffer of the host's ``BufferPool``), each
frame is decrypted once (big stream frames into another pooled buffer, others into fresh bytes)
and dispatched. RPC
requests run as tasks owned by their connection (cancelled when the caller sends CANCEL or the
connection dies); bulk streams are ``stream.Stream`` objects.

Everything a peer sends is untrusted: frame sizes are checked before allocation, handshakes and
frames have deadlines (slow-loris senders are cut off), each connection has a cap on concurrent
requests and streams, and any protocol violation closes that one connection, never the process.

A host with a ``swarm_key`` is in a private swarm: the key enters every handshake (see ``noise``),
and a peer without it (or with another) is refused at the first handshake message. The listener
logs one WARNING line per remote address and minute (a stranger retrying in a loop cannot flood
the log); the dialer's ``connect`` raises :class:`~dht.noise.SwarmKeyMismatch` saying why.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .aio import wait_event
from .errors import (
    DHTError,
    HandshakeError,
    PeerUnreachable,
    ProtocolError,
    RPCError,
    RPCTimeout,
)
from .identity import Identity, PeerID
from .multiaddr import Multiaddr
from .noise import REFUSAL_SIZE, CipherState, StaticKey, SwarmKeyMismatch, XXHandshake
from .swarmkey import SwarmKey, load_swarm_key
from .stream import WINDOW_BODY, Stream
from .wire import (
    HEADER_SIZE,
    LEGACY_FRAME_BODY,
    LENGTH,
    MAX_CONTROL_FRAME,
    MAX_FRAME,
    MAX_FRAME_BODY,
    MAX_HANDSHAKE_FRAME,
    MAX_MESSAGE,
    TAG_SIZE,
    FrameReader,
    Kind,
    pack,
    pack_header,
    parse_header,
    unpack,
)

if TYPE_CHECKING:
    from .relay import RelayClient

log = logging.getLogger("dht.transport")

DEFAULT_PROLOGUE = b"p2ptrain/noise/1"
_HS_LEN = struct.Struct(">H")

RequestHandler = Callable[["Connection", Any], Awaitable[Any]]
StreamHandler = Callable[[Stream], Awaitable[None]]


@dataclass
class Limits:
    """Per-connection and per-host bounds that keep a hostile peer from exhausting us."""

    handshake_timeout: float = 10.0
    frame_timeout: float = 30.0  # a started frame must complete within this (slow-loris guard)
    idle_timeout: float = 300.0  # connections with nothing in flight are closed after this
    max_concurrent_requests: int = 64  # per connection; more get a "busy" error
    #: Requests a peer may send on one connection per second, with bursts of ``request_burst``
    #: (a token bucket; 0 disables). Past it we stop reading that peer's socket until a token is
    #: due: its requests wait in the kernel's buffers and TCP pushes back on it, instead of every
    #: one costing us a decrypt, a decode and a handler on the event loop that training shares.
    #: Honest peers send tens to a few hundred per second: about 18 per epoch (matchmaking polls,
    #: progress reports, DHT lookups), measured at up to 146/s per connection in a 4-peer swarm
    #: taking 8 epochs a second; the default leaves such fast small-model swarms a wide margin.
    request_rate: float = 1000.0
    request_burst: int = 2000
    max_streams: int = 64  # per connection, both directions
    stream_window: int = 8 << 20
    #: Memory a peer can make us hold: every stream it opens may fill its window (``stream_window``)
    #: with data its handler has not read yet, so streams opened by the remote side are capped per
    #: connection (16 x 8 MiB = 128 MiB per peer, with at most 64 x 1 MiB RPC bodies in flight) and,
    #: summed over all connections, to ``max_inbound_stream_memory`` of windows (128 streams by
    #: default). Past either cap a new stream is reset with a reason ("too many streams", "busy")
    #: and the streams already open go on. An averaging round opens 1-2 streams per peer pair.
    max_inbound_streams: int = 16
    max_inbound_stream_memory: int = 1 << 30
    #: A peer whose streams were refused for capacity this many times is disconnected: each
    #: refused stream may still bring a window of data in flight (decrypted, then dropped), so a
    #: peer that keeps opening past the caps costs us bandwidth and CPU without holding memory.
    max_refused_streams: int = 64
    max_connections: int = 1024
    #: inbound connections still in their handshake, from all addresses / from one IP address.
    #: Past either cap a new inbound connection is closed at once: a flood of sockets that never
    #: finish a handshake (held open until ``handshake_timeout``) cannot fill ``max_connections``
    #: and lock out real peers (measured by benchmarks/flood.py). Per IP it stays well above what
    #: a local swarm of a few hundred nodes on 127.0.0.1 opens at once when they all join.
    max_handshakes: int = 256
    max_handshakes_per_ip: int = 64
    write_buffer_high: int = 4 << 20
    #: frame buffers (up to 4 MiB each, sized to the frames) a host keeps for reuse by big frames,
    #: received, decrypted or encrypted, shared by all its connections; 0 disables (a connection
    #: then keeps a receive buffer of its own). An 8-member all-reduce holds ~20-30 at its peak
    #: (frames queued in 14 streams, both ways, and the ones being received); each pool miss
    #: costs a zero-filled, page-faulting allocation. Buffers are only allocated when that many
    #: frames are in flight at once, so a DHT-only node never holds any.
    buffer_pool: int = 32


#: stream data frames at least this large are encrypted/decrypted into pooled buffers
POOLED_FRAME_MIN = 256 * 1024


class LogThrottle:
    """Whether to log an event about a remote address now: at most once per ``interval`` seconds
    per address, counting the events held back. Sans-IO (the caller passes the time); at most
    ``max_addresses`` are remembered, so a flood from many addresses cannot grow it either."""

    def __init__(self, interval: float = 60.0, max_addresses: int = 4096):
        self.interval = interval
        self.max_addresses = max_addresses
        self._last: dict[str, tuple[float, int]] = {}  # address -> (when last logged, held back since)

    def allow(self, address: str, now: float) -> int | None:
        """None: stay quiet. Else log, mentioning the returned number of events held back."""
        last = self._last.get(address)
        if last is not None and now - last[0] < self.interval:
            self._last[address] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self.max_addresses:
            self._last = {a: v for a, v in self._last.items() if now - v[0] < self.interval}
            if len(self._last) >= self.max_addresses:
                return None  # flooded from everywhere: one line per address already went out
        self._last[address] = (now, 0)
        return last[1] if last is not None else 0


class BufferPool:
    """Frame-sized bytearrays handed out again once nothing references them any more.

    Allocating a fresh multi-MiB buffer per frame churns malloc: freed memory goes back to the
    kernel and every reuse page-faults (~1000 faults per 4 MiB frame, measured at 20-30% of an
    all-reduce round's CPU time). A buffer here is reused only when the pool holds the one
    reference left: a consumer still holding a view of a decrypted frame (a memoryview or a tensor
    over it), or the socket transport still queueing an encrypted frame, keeps it out of reuse, so
    no one ever sees its bytes change underneath.

    Buffers are sized to what is asked (rounded up to ``granule``), not all to the largest frame:
    an int8 all-reduce sends ~1 MiB frames, and with every one of them in a 4 MiB buffer a member
    held 10-11 of them (44 MiB) where ~12 MiB hold the same frames. A request takes an idle buffer
    of at least its size and at most twice it; when the pool is full, a new size replaces an idle
    buffer of another size (the traffic changed), so the pool follows the frames in use.
    """

    __slots__ = ("size", "keep", "granule", "_bufs", "_idle_refs")

    def __init__(self, size: int, keep: int, granule: int = 64 << 10):
        self.size = size  # the largest buffer asked for (a whole frame)
        self.keep = keep
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
        want = self.size if n is None else min(self.size, -(-max(n, 1) // self.granule) * self.granule)
        bufs = self._bufs
        other = -1  # an idle buffer of another size: replaced when the pool is full
        for i in range(len(bufs)):  # (by index: a loop variable would count as a reference)
            if self._refs(i) <= self._idle_refs:
                if want <= len(bufs[i]) <= 2 * want:
                    return bufs[i]
                if other < 0:
                    other = i
        buf = bytearray(want)
        if len(bufs) < self.keep:
            bufs.append(buf)
        elif other >= 0:
            bufs[other] = buf
        return buf

    def clear(self) -> None:
        self._bufs.clear()


class Connection(asyncio.BufferedProtocol):
    """One secure connection. Created by ``Host``; use ``call`` and ``open_stream``."""

    def __init__(self, host: Host, initiator: bool, expected_peer: PeerID | None = None):
        self.host = host
        self.initiator = initiator
        self.expected_peer = expected_peer
        self.remote_peer: PeerID | None = None  # set once the handshake proves it
        self.remote_host: str | None = None
        self.remote_port: int | None = None  # the socket's (ephemeral) port, for log lines
        self.remote_listen_port: int | None = None
        self.remote_window = host.limits.stream_window  # the peer's receive window per stream
        self.max_data_body = LEGACY_FRAME_BODY  # largest stream data frame the peer accepts
        self.ready: asyncio.Future[Connection] = host.loop.create_future()
        self._transport: asyncio.Transport | None = None
        # made once the host accepts the connection (connection_made): its ephemeral key costs
        # ~0.1 ms, which a flood of connections closed at once at the caps should not make us pay
        self._hs: XXHandshake = None  # type: ignore[assignment]
        self._hs_buf = bytearray()
        self._hs_inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._hs_expected = 1 if initiator else 2
        self._early_frames: list[bytes] = []
        self._reader = FrameReader(alloc=host.pool.get if host.pool.keep else None)
        self._send: CipherState | None = None
        self._recv: CipherState | None = None
        self._next_id = 1 if initiator else 2  # odd ids for the dialer, even for the listener
        self._calls: dict[int, asyncio.Future] = {}
        self._serving: dict[int, asyncio.Task] = {}
        self._streams: dict[int, Stream] = {}
        self._inbound: set[int] = set()  # ids of the streams the remote side opened
        self._refused_streams = 0  # its stream opens we refused for capacity (see Limits)
        self._tasks: set[asyncio.Task] = set()
        self._write_ok = asyncio.Event()
        self._write_ok.set()
        self._closed = False
        self.close_reason: str | None = None
        now = time.monotonic()
        self.last_activity = now
        self.partial_since: float | None = None
        self.opened_at = now
        self.bytes_sent = 0
        self.bytes_received = 0
        self._tokens = float(host.limits.request_burst)  # request_rate's bucket
        self._tokens_at = now
        self._throttled: asyncio.TimerHandle | None = None
        self.throttled_s = 0.0  # time this peer's socket was left unread for going over the rate

    # ------------------------------------------------------------------ protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peername = transport.get_extra_info("peername")
        if peername:
            self.remote_host = peername[0]
            self.remote_port = peername[1] if len(peername) > 1 else None
        self._transport.set_write_buffer_limits(high=self.host.limits.write_buffer_high)
        if not self.host.accepting_connection(self):
            return
        host = self.host
        self._hs = XXHandshake(
            host.identity,
            self.initiator,
            prologue=host.prologue,
            expected_peer=self.expected_peer,
            local_payload={"port": host.listen_port, "window": host.limits.stream_window, "frame": MAX_FRAME_BODY},
            static=host.static_key,
            psk=host.swarm_key.secret if host.swarm_key is not None else None,
        )
        self._spawn(self._handshake())

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._hs_expected:
            self._hs_chunk = bytearray(MAX_HANDSHAKE_FRAME + 2)
            return memoryview(self._hs_chunk)
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        # Whatever a peer sends, only this connection can fail because of it.
        try:
            self.bytes_received += nbytes
            now = time.monotonic()
            self.last_activity = now
            if self._hs_expected:
                # The last handshake message may share a packet with the start of a frame.
                self._on_handshake_bytes(memoryview(self._hs_chunk)[:nbytes])
            else:
                for frame in self._reader.buffer_updated(nbytes):
                    if self._closed:
                        return
                    self._on_frame(frame)
            self.partial_since = (self.partial_since or now) if self._reader.partial else None
        except ProtocolError as e:
            self.close(str(e), abort=True)
        except Exception as e:  # a bug must not take the event loop down with it
            log.exception("internal error on connection to %s", self.remote_peer)
            self.close(f"internal error: {e!r}", abort=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._teardown(self.close_reason or (f"connection lost: {exc}" if exc else "connection closed by peer"))

    def pause_writing(self) -> None:
        self._write_ok.clear()

    def resume_writing(self) -> None:
        self._write_ok.set()

    # ------------------------------------------------------------------ handshake

    async def _handshake(self) -> None:
        hs = self._hs
        try:
            async with asyncio.timeout(self.host.limits.handshake_timeout):
                if self.initiator:
                    self._write_hs(hs.write_message())
                    hs.read_message(await self._hs_inbox.get())
                    self._write_hs(hs.write_message())
                else:
                    hs.read_message(await self._hs_inbox.get())
                    self._write_hs(hs.write_message())
                    hs.read_message(await self._hs_inbox.get())
        except TimeoutError:
            self._fail_handshake("handshake timed out")
            return
        except SwarmKeyMismatch as e:
            self._refuse(e)
            return
        except HandshakeError as e:
            self._fail_handshake(str(e), e)
            return
        except Exception as e:  # never leave ``ready`` pending: a dialer would wait its full timeout
            log.exception("handshake with %s crashed", self.remote_host)
            self._fail_handshake(f"handshake failed: {e!r}")
            return
        self._send, self._recv = hs.send_cipher, hs.recv_cipher
        self.remote_peer = hs.remote_peer
        port = hs.remote_payload.get("port")
        self.remote_listen_port = port if isinstance(port, int) and 0 < port < 65536 else None
        window = hs.remote_payload.get("window")
        if isinstance(window, int) and 0 < window < 2**32:
            self.remote_window = window
        frame = hs.remote_payload.get("frame")
        if isinstance(frame, int) and not isinstance(frame, bool) and LEGACY_FRAME_BODY <= frame:
            self.max_data_body = min(frame, MAX_FRAME_BODY)
        self._hs = None  # type: ignore[assignment]  # drop ephemeral keys
        early, self._early_frames = self._early_frames, []
        try:
            for frame in early:
                self._on_frame(memoryview(frame))
        except ProtocolError as e:
            self.close(str(e), abort=True)
            return
        if self._closed:
            return
        self.host.connection_ready(self)
        if not self.ready.done():
            self.ready.set_result(self)

    def _refuse(self, error: SwarmKeyMismatch) -> None:
        """Another swarm's peer: tell it why (listener side) and close, flushing the refusal."""
        if not error.refused_by_peer:
            self._write_hs(XXHandshake.refusal(error))
            self.host.log_refusal(self.remote_host, self.remote_port, str(error))
        else:
            log.info("handshake with %s failed: %s", self.remote_host, error)
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # mark retrieved: a listener-side refusal has no awaiter
        self.close(str(error))  # not an abort: the refusal must reach the peer

    def _fail_handshake(self, reason: str, error: HandshakeError | None = None) -> None:
        """``error``: the handshake's own exception, handed to the dialer as it is (its class
        tells a wrong peer id, ``PeerIdMismatch``, from a transient failure)."""
        log.info("handshake with %s failed: %s", self.remote_host, reason)
        if not self.ready.done():
            self.ready.set_exception(error if error is not None else HandshakeError(reason))
            self.ready.exception()  # mark retrieved: a listener-side failure has no awaiter
        self.close(reason, abort=True)

    def _write_hs(self, message: bytes) -> None:
        if self._transport is not None and not self._closed and not self._transport.is_closing():
            try:
                self._transport.write(_HS_LEN.pack(len(message)) + message)
            except RuntimeError:  # uvloop: the handle died under us (is_closing() can lag behind)
                self.close("connection lost during the handshake", abort=True)

    def _on_handshake_bytes(self, data: memoryview) -> None:
        self._hs_buf += data
        if len(self._hs_buf) > 2 * (MAX_HANDSHAKE_FRAME + 2):
            raise HandshakeError("handshake message too large (not a p2ptrain peer?)")
        while self._hs_expected and len(self._hs_buf) >= 2:
            (n,) = _HS_LEN.unpack_from(self._hs_buf)
            if n > MAX_HANDSHAKE_FRAME:
                raise HandshakeError("handshake message too large (not a p2ptrain peer?)")
            if len(self._hs_buf) < 2 + n:
                return
            if self.initiator and n == REFUSAL_SIZE and self._hs_expected == 1:
                # Handled here, not by the handshake task: the listener closes right after its
                # refusal, and connection_lost would cancel the task before it read the reason.
                self._refuse(SwarmKeyMismatch(self._hs_buf[2], refused_by_peer=True))
                return
            self._hs_inbox.put_nowait(bytes(self._hs_buf[2 : 2 + n]))
            del self._hs_buf[: 2 + n]
            self._hs_expected -= 1
        if not self._hs_expected and self._hs_buf:
            rest, self._hs_buf = bytes(self._hs_buf), bytearray()
            self._early_frames.extend(self._reader.feed(rest))

    # ------------------------------------------------------------------ frames in

    def _on_frame(self, frame: memoryview) -> None:
        if self._recv is None:
            if len(self._early_frames) >= 16:
                raise ProtocolError("too many frames before the handshake completed")
            self._early_frames.append(bytes(frame))
            return
        header = bytes(frame[:HEADER_SIZE])
        kind, _flags, ident = parse_header(header)
        if len(frame) < HEADER_SIZE + TAG_SIZE:
            raise ProtocolError("frame shorter than its authentication tag")
        if len(frame) > MAX_CONTROL_FRAME and kind != Kind.STREAM_DATA:
            raise ProtocolError(f"frame of kind {kind} exceeds the {MAX_MESSAGE}-byte message limit")
        if kind == Kind.STREAM_DATA and ident not in self._streams:
            # Data for a stream we reset or never had (it was in flight when the reset left, or
            # the peer ignores resets): authenticated, then dropped. Decrypted into one reusable
            # scratch buffer, not a fresh one per frame: a peer pushing data into refused streams
            # otherwise makes us allocate (and the allocator keep) hundreds of MB a second.
            n = len(frame) - HEADER_SIZE - TAG_SIZE
            if n > MAX_FRAME_BODY:
                raise ProtocolError("stream data frame larger than the frame limit")
            self._recv.decrypt_into(header, frame[HEADER_SIZE:], self.host.discard_buffer[:n])
            return
        if kind == Kind.STREAM_DATA and len(frame) >= POOLED_FRAME_MIN and self.host.pool.keep:
            # decrypted into a pooled buffer; handed on read-only and never reused while viewed
            n = len(frame) - HEADER_SIZE - TAG_SIZE
            view = memoryview(self.host.pool.get(n))[:n]
            self._recv.decrypt_into(header, frame[HEADER_SIZE:], view)
            view = view.toreadonly()
        else:
            view = memoryview(self._recv.decrypt(header, frame[HEADER_SIZE:]))  # fresh, read-only bytes
        if kind == Kind.REQUEST:
            if self._spend_request_token():
                self._on_request(ident, view)
            else:  # frames of one read already in hand: refused cheaply, no handler runs
                self.post(Kind.ERROR, ident, pack("busy: more requests than this peer serves per second"))
        elif kind == Kind.RESPONSE or kind == Kind.ERROR:
            fut = self._calls.get(ident)
            if fut is not None and not fut.done():
                if kind == Kind.RESPONSE:
                    fut.set_result(unpack(view))
                else:
                    reason = unpack(view)
                    fut.set_exception(RPCError(f"{self.remote_peer}: {reason if isinstance(reason, str) else 'error'}"))
        elif kind == Kind.CANCEL:
            task = self._serving.get(ident)
            if task is not None:
                task.cancel()
        elif kind == Kind.STREAM_OPEN:
            self._on_stream_open(ident, view)
        elif kind == Kind.GOAWAY:  # a connection-level frame: its id names no stream
            self.close("peer is going away")
        else:
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
                stream._on_reset(f"reset by peer: {reason if isinstance(reason, str) else 'reset'}")

    def _on_request(self, ident: int, body: memoryview) -> None:
        if ident in self._serving:
            raise ProtocolError("request id reused while in flight")
        msg = unpack(body)
        if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], str)):
            raise ProtocolError("malformed request")
        method, args = msg
        if len(self._serving) >= self.host.limits.max_concurrent_requests:
            self.post(Kind.ERROR, ident, pack("busy: too many concurrent requests"))
            return
        handler = self.host._handlers.get(method)
        if handler is None:
            self.post(Kind.ERROR, ident, pack(f"unknown method {method!r}"))
            return
        task = self._spawn(self._serve(ident, method, handler, args))
        self._serving[ident] = task

    async def _serve(self, ident: int, method: str, handler: RequestHandler, args: Any) -> None:
        try:
            result = await handler(self, args)
            body = pack(result)
            if len(body) > MAX_MESSAGE:  # the peer would drop the connection over such a frame
                log.warning("handler %s replied with %d bytes, over the %d-byte message limit", method,
                            len(body), MAX_MESSAGE)
                body = pack(f"{method}: reply of {len(body)} bytes exceeds the {MAX_MESSAGE}-byte message limit")
                self.post(Kind.ERROR, ident, body)
                return
            self.post(Kind.RESPONSE, ident, body)
        except asyncio.CancelledError:
            pass
        except (DHTError, ValueError, TypeError, KeyError) as e:
            # Includes schema errors from validating the peer's arguments: report, do not crash.
            self.post(Kind.ERROR, ident, pack(f"{method}: {e}"[:500]))
        except Exception:
            log.exception("handler %s failed", method)
            self.post(Kind.ERROR, ident, pack(f"{method}: internal error"))
        finally:
            self._serving.pop(ident, None)

    def _spend_request_token(self) -> bool:
        """Account one request against ``Limits.request_rate``: False when the bucket is empty.
        Then the socket is left unread until a token is due, and the requests of the current read
        that are over the limit get a "busy" error (the caller may retry) instead of a handler."""
        rate = self.host.limits.request_rate
        if rate <= 0:
            return True
        now = time.monotonic()
        self._tokens = min(float(self.host.limits.request_burst), self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        allowed = self._tokens >= 1.0
        if allowed:
            self._tokens -= 1.0
        if self._tokens < 1.0 and self._throttled is None and self._transport is not None:
            # the bucket is empty: read this peer's next request only once it has a token
            wait = (1.0 - self._tokens) / rate
            self.throttled_s += wait
            self._transport.pause_reading()
            self._throttled = self.host.loop.call_later(wait, self._unthrottle)
        return allowed

    def _unthrottle(self) -> None:
        self._throttled = None
        if not self._closed and self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _on_stream_open(self, ident: int, body: memoryview) -> None:
        if ident in self._streams or (ident % 2 == 1) != (not self.initiator):
            raise ProtocolError("bad stream id")
        msg = unpack(body)
        if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], str)):
            raise ProtocolError("malformed stream open")
        protocol, header = msg
        host, limits = self.host, self.host.limits
        handler = host._stream_handlers.get(protocol)
        reason = None
        if handler is None:
            reason = f"unknown protocol {protocol!r}"
        elif len(self._streams) >= limits.max_streams or len(self._inbound) >= limits.max_inbound_streams:
            reason = "too many streams"
        elif host.inbound_stream_memory + limits.stream_window > limits.max_inbound_stream_memory:
            reason = "busy: too many incoming streams on this host; retry later"
            host.log_refusal(self.remote_host, self.remote_port, f"stream {protocol!r} from {self.remote_peer}: {reason}")
        if reason is not None:
            self.post(Kind.STREAM_RESET, ident, pack(reason))
            if handler is not None:
                self._refused_streams += 1
                if self._refused_streams > limits.max_refused_streams:
                    host.log_refusal(self.remote_host, self.remote_port,
                                     f"{self.remote_peer}: kept opening streams past our limits; disconnected")
                    self.close(f"opened {self._refused_streams} streams past our limits", abort=True)
            return
        stream = self._add_stream(ident, protocol, header)
        self._inbound.add(ident)
        host.inbound_stream_memory += limits.stream_window
        self._spawn(self._serve_stream(stream, handler))

    async def _serve_stream(self, stream: Stream, handler: StreamHandler) -> None:
        try:
            await handler(stream)
            stream.write_eof()
        except asyncio.CancelledError:
            stream.reset("cancelled")
        except DHTError as e:
            stream.reset(str(e)[:200])
        except Exception:
            log.exception("stream handler %s failed", stream.protocol)
            stream.reset("internal error")

    # ------------------------------------------------------------------ frames out

    def pack(self, obj: Any) -> bytes:
        return pack(obj)

    def send_frame(self, kind: Kind, ident: int, body: bytes | bytearray | memoryview = b"") -> None:
        """Encrypt ``body`` (read in place, never copied first) and hand the frame to the socket.

        Large frames are encrypted into a pooled buffer (see ``BufferPool``), small ones into a
        fresh ``bytes``; either goes out with the length/header prefix in one ``writelines``.
        """
        # uvloop raises RuntimeError on a write to a closing socket, before connection_lost runs.
        if self._closed or self._send is None or self._transport is None or self._transport.is_closing():
            raise PeerUnreachable(f"connection to {self.remote_peer} is closed ({self.close_reason})")
        header = pack_header(kind, ident)
        n = len(body) if type(body) is not memoryview else body.nbytes
        if n + TAG_SIZE >= POOLED_FRAME_MIN and n <= MAX_FRAME_BODY and self.host.pool.keep:
            # into a pooled buffer, reused only after the transport has let go of it
            ciphertext = memoryview(self.host.pool.get(n + TAG_SIZE))[: n + TAG_SIZE]
            self._send.encrypt_into(header, body, ciphertext)
        else:
            ciphertext = self._send.encrypt(header, body)
        try:
            self._transport.writelines((LENGTH.pack(HEADER_SIZE + len(ciphertext)) + header, ciphertext))
        except RuntimeError:  # uvloop: the handle died under us (is_closing() can lag behind)
            self.close("connection lost", abort=True)
            raise PeerUnreachable(f"connection to {self.remote_peer} is closed") from None
        self.bytes_sent += LENGTH.size + HEADER_SIZE + len(ciphertext)
        self.last_activity = time.monotonic()

    def post(self, kind: Kind, ident: int, body: bytes | bytearray | memoryview = b"") -> None:
        """Send a control frame (reply, cancel, window, end, reset) if the connection is still
        open; when it is not, the frame has no one to reach and dropping it is correct."""
        try:
            self.send_frame(kind, ident, body)
        except PeerUnreachable:  # closed, or the socket is already closing: connection_lost follows
            pass

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until the socket's write buffer is below its high-water mark."""
        if self._write_ok.is_set():
            return
        if not await wait_event(self._write_ok, timeout):
            raise RPCTimeout(f"peer {self.remote_peer} is not reading (write stalled {timeout} s)") from None
        if self._closed:
            raise PeerUnreachable(f"connection to {self.remote_peer} closed ({self.close_reason})")

    def _new_id(self) -> int:
        ident = self._next_id
        self._next_id += 2
        if self._next_id >= 2**32:
            raise PeerUnreachable("id space exhausted on this connection; reconnect")
        return ident

    # ------------------------------------------------------------------ public API

    async def call(self, method: str, args: Any = None, timeout: float = 5.0) -> Any:
        """Call ``method`` on the remote peer; raises RPCTimeout, RPCError or PeerUnreachable."""
        ident = self._new_id()
        fut = self.host.loop.create_future()
        self._calls[ident] = fut
        try:
            self.send_frame(Kind.REQUEST, ident, pack([method, args]))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self._cancel_remote(ident)
            raise RPCTimeout(f"{method} to {self.remote_peer} timed out after {timeout} s") from None
        except asyncio.CancelledError:
            self._cancel_remote(ident)
            raise
        finally:
            self._calls.pop(ident, None)

    def _cancel_remote(self, ident: int) -> None:
        self.post(Kind.CANCEL, ident)

    async def open_stream(self, protocol: str, header: Any = None) -> Stream:
        """Open a bulk stream served by the remote's handler for ``protocol``."""
        if len(self._streams) >= self.host.limits.max_streams:
            raise PeerUnreachable(f"too many open streams to {self.remote_peer}")
        ident = self._new_id()
        stream = self._add_stream(ident, protocol, header)
        self.send_frame(Kind.STREAM_OPEN, ident, pack([protocol, header]))
        return stream

    def _add_stream(self, ident: int, protocol: str, header: Any) -> Stream:
        """A stream that accepts our window and sends within the remote's announced one."""
        stream = Stream(self, ident, protocol, header, self.host.limits.stream_window, self.remote_window)
        self._streams[ident] = stream
        return stream

    def forget_stream(self, ident: int) -> None:
        self._streams.pop(ident, None)
        if ident in self._inbound:
            self._inbound.discard(ident)
            self.host.inbound_stream_memory -= self.host.limits.stream_window

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def busy(self) -> bool:
        return bool(self._calls or self._serving or self._streams)

    def close(self, reason: str = "closed", abort: bool = False) -> None:
        if self._closed:
            return
        self.close_reason = reason
        if self._transport is not None:
            if abort:
                self._transport.abort()
            else:
                self._transport.close()
        self._teardown(reason)

    def _teardown(self, reason: str) -> None:
        first = not self._closed
        self._closed = True
        self.close_reason = self.close_reason or reason
        if not first:
            return
        # A writer blocked in drain() on a paused socket gets no resume_writing() once the
        # connection is lost: wake it, and drain() raises PeerUnreachable at once instead of
        # sitting out its whole timeout (the survivors of a crash mid-round waited 35 s on this).
        self._write_ok.set()
        err = PeerUnreachable(f"connection to {self.remote_peer or self.remote_host} closed: {self.close_reason}")
        if not self.ready.done():
            self.ready.set_exception(HandshakeError(self.close_reason) if self.remote_peer is None else err)
            self.ready.exception()  # mark retrieved: a listener-side failure has no awaiter
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        for stream in list(self._streams.values()):
            stream._on_reset(self.close_reason)
        for task in list(self._tasks):
            task.cancel()
        if self._throttled is not None:
            self._throttled.cancel()
        self.host.connection_closed(self)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = self.host.loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class Host:
    """A peer's network presence: listener, connection pool, handlers, and every task they own.

    ``listen=None`` is client mode: the host dials out but accepts nothing, for peers behind NAT
    or firewalls; it can still call any method and open streams on the connections it makes.
    ``reserve_relay`` makes such a host reachable all the same, through a relay (``dht.relay``).
    """

    def __init__(
        self,
        identity: Identity,
        listen: tuple[str, int] | None = ("127.0.0.1", 0),
        *,
        prologue: bytes = DEFAULT_PROLOGUE,
        limits: Limits | None = None,
        announce_host: str | None = None,
        swarm_key: SwarmKey | bytes | None = None,
    ):
        self.identity = identity
        self.peer_id = identity.peer_id
        self.prologue = prologue
        #: the private swarm's key (None: a public swarm); never logged, see SwarmKey.fingerprint
        self.swarm_key: SwarmKey | None = load_swarm_key(swarm_key) if swarm_key is not None else None
        self._refusals = LogThrottle()
        self.static_key = StaticKey(identity)
        self.limits = limits or Limits()
        self._listen = listen
        self._announce_host = announce_host
        self.listen_port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._handlers: dict[str, RequestHandler] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._conns: dict[PeerID, Connection] = {}  # the connection we use for calls to a peer
        self._all: set[Connection] = set()
        self._handshaking: set[Connection] = set()  # inbound connections still in their handshake
        self._handshakes_per_ip: dict[str, int] = {}
        self._disconnect_listeners: list[Callable[[PeerID], None]] = []
        self._dialing: dict[tuple[str, int, PeerID | None], asyncio.Future[Connection]] = {}
        self._relay_client: RelayClient | None = None
        #: windows of the streams remote peers opened to us, summed (see Limits.max_inbound_streams)
        self.inbound_stream_memory = 0
        self._watchdog: asyncio.Task | None = None
        self._closed = False
        self.on_connect: list[Callable[[Connection], None]] = []
        self.pool = BufferPool(MAX_FRAME, self.limits.buffer_pool)  # (a whole frame: connections receive into them too)
        self._discard: memoryview | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    @property
    def discard_buffer(self) -> memoryview:
        """Where frames whose content is dropped unread are decrypted (one buffer, reused: the
        event loop handles one frame at a time). Allocated on first use."""
        if self._discard is None:
            self._discard = memoryview(bytearray(MAX_FRAME_BODY))
        return self._discard

    @property
    def client_mode(self) -> bool:
        return self._listen is None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self._listen is not None:
            host, port = self._listen
            self._server = await self.loop.create_server(
                lambda: Connection(self, initiator=False), host, port, reuse_address=True, backlog=1024
            )
            self.listen_port = self._server.sockets[0].getsockname()[1]
        self._watchdog = self.loop.create_task(self._watch())

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """Full multiaddrs (with /p2p/<id>) others can dial: the direct one first (none in client
        mode), then a circuit address per relay that holds a reservation for us."""
        circuits = self._relay_client.addrs if self._relay_client is not None else []
        if self._server is None or self.listen_port is None:
            return circuits
        host = self._announce_host or self._listen[0]  # type: ignore[index]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return [Multiaddr.from_host_port(host, self.listen_port, self.peer_id), *circuits]

    async def reserve_relay(self, relay: Multiaddr | str, timeout: float = 5.0) -> Multiaddr:
        """Become reachable through the relay at ``relay`` (a peer running ``relay.RelayService``,
        full address with /p2p/<id>): reserves a slot there and keeps it while this host runs,
        reconnecting when the connection drops. Returns our circuit address through it, which
        ``listen_addrs`` then lists too. Raises (e.g. ``relay.RelayRefused``) if the first try fails."""
        if self._closed or self.loop is None:
            raise PeerUnreachable("start the host before reserving a relay" if not self._closed else "host is closed")
        if self._relay_client is None:
            from .relay import RelayClient  # relay builds on this module

            self._relay_client = RelayClient(self)
        return await self._relay_client.reserve(relay, timeout)

    def on_request(self, method: str, handler: RequestHandler) -> None:
        self._handlers[method] = handler

    def off_request(self, method: str, handler: RequestHandler | None = None) -> None:
        """Stop answering ``method`` (only if its handler is still ``handler``, when given: a
        component closing must not remove what another one registered since)."""
        if handler is None or self._handlers.get(method) == handler:
            self._handlers.pop(method, None)

    def on_stream(self, protocol: str, handler: StreamHandler) -> None:
        self._stream_handlers[protocol] = handler

    def off_stream(self, protocol: str) -> None:
        """Stop accepting new streams of ``protocol`` (open ones are left to their handler)."""
        self._stream_handlers.pop(protocol, None)

    # ------------------------------------------------------------------ connections

    def connection(self, peer: PeerID) -> Connection | None:
        conn = self._conns.get(peer)
        return conn if conn is not None and not conn.is_closed else None

    @property
    def connections(self) -> list[Connection]:
        return [c for c in self._conns.values() if not c.is_closed]

    async def connect(
        self, host: str, port: int, peer: PeerID | None = None, timeout: float = 5.0
    ) -> Connection:
        """A ready connection to ``peer`` at host:port, reusing an open one. When ``peer`` is
        given, reaching anyone else fails with HandshakeError (no impersonation)."""
        if self._closed:
            raise PeerUnreachable("host is closed")
        if peer is not None:
            existing = self.connection(peer)
            if existing is not None:
                return existing
            if peer == self.peer_id:
                raise PeerUnreachable("refusing to dial ourselves")
        return await self._dial_once((host, port, peer), lambda: self._dial(host, port, peer, timeout))

    async def _dial_once(self, key: tuple[str, int, PeerID | None],
                         dial: Callable[[], Awaitable[Connection]]) -> Connection:
        """One dial per ``key`` at a time: concurrent callers share it."""
        pending = self._dialing.get(key)
        if pending is None:
            pending = self.loop.create_task(dial())  # type: ignore[assignment,arg-type]
            self._dialing[key] = pending
            pending.add_done_callback(lambda _f: self._dialing.pop(key, None))
            # Every waiter may have been cancelled: mark a failure as seen so asyncio stays quiet.
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(pending)

    async def _dial(self, host: str, port: int, peer: PeerID | None, timeout: float) -> Connection:
        conn: Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                _transport, conn = await self.loop.create_connection(
                    lambda: Connection(self, initiator=True, expected_peer=peer), host, port
                )
                return await conn.ready
        except TimeoutError:
            if conn is not None:
                conn.close("dial timed out", abort=True)
            raise PeerUnreachable(f"dial to {host}:{port} timed out after {timeout} s") from None
        except OSError as e:
            raise PeerUnreachable(f"cannot reach {host}:{port}: {e.strerror or e}") from None

    async def connect_addr(self, addr: Multiaddr, timeout: float = 5.0) -> Connection:
        """A ready connection to the peer at ``addr``, reusing an open one; a circuit address
        (``.../p2p/<relay>/p2p-circuit/p2p/<peer>``) is dialed through its relay, end-to-end secure."""
        if addr.is_circuit:
            return await self._connect_circuit(addr, timeout)
        host = addr.host
        if addr.host_proto.startswith("dns"):
            family = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6}.get(addr.host_proto, 0)
            try:
                infos = await asyncio.wait_for(
                    self.loop.getaddrinfo(addr.host, addr.port, family=family, type=socket.SOCK_STREAM), timeout
                )
            except (OSError, TimeoutError) as e:
                raise PeerUnreachable(f"cannot resolve {addr.host}: {e}") from None
            host = infos[0][4][0]
        return await self.connect(host, addr.port, addr.peer_id, timeout)

    async def _connect_circuit(self, addr: Multiaddr, timeout: float) -> Connection:
        from .relay import dial_circuit  # relay builds on this module

        target = addr.peer_id
        assert target is not None and addr.relay_id is not None
        if self._closed:
            raise PeerUnreachable("host is closed")
        existing = self.connection(target)
        if existing is not None:
            return existing
        if target == self.peer_id:
            raise PeerUnreachable("refusing to dial ourselves")
        # the key's "host" cannot collide with a real address: it holds the relay's id
        key = (f"p2p-circuit/{addr.relay_id}", 0, target)
        return await self._dial_once(key, lambda: dial_circuit(self, addr, timeout))

    async def call(self, peer: PeerID, addr: tuple[str, int] | None, method: str, args: Any = None,
                   timeout: float = 5.0) -> Any:
        """Call ``method`` on ``peer``, dialing ``addr`` when no connection is open."""
        conn = self.connection(peer)
        if conn is None:
            if addr is None:
                raise PeerUnreachable(f"no connection to {peer} and no address to dial")
            conn = await self.connect(addr[0], addr[1], peer, timeout)
        return await conn.call(method, args, timeout)

    # ------------------------------------------------------------------ bookkeeping (from Connection)

    def log_refusal(self, host: str | None, port: int | None, reason: str) -> None:
        """One WARNING line per remote address and minute for peers refused at the handshake."""
        address = host or "?"
        held = self._refusals.allow(address, time.monotonic())
        if held is None:
            return
        more = f" ({held} more from {address} since the last report)" if held else ""
        log.warning("refused %s:%s: %s%s", address, port if port is not None else "?", reason, more)

    def accepting_connection(self, conn: Connection) -> bool:
        if self._closed or len(self._all) >= self.limits.max_connections:
            conn.close("too many connections", abort=True)
            return False
        if not conn.initiator:
            ip = conn.remote_host or "?"
            if len(self._handshaking) >= self.limits.max_handshakes:
                conn.close("too many handshakes in progress", abort=True)
                return False
            if self._handshakes_per_ip.get(ip, 0) >= self.limits.max_handshakes_per_ip:
                conn.close(f"too many handshakes in progress from {ip}", abort=True)
                return False
            self._handshaking.add(conn)
            self._handshakes_per_ip[ip] = self._handshakes_per_ip.get(ip, 0) + 1
        self._all.add(conn)
        return True

    def _handshake_over(self, conn: Connection) -> None:
        """``conn`` (inbound) finished its handshake or closed: it no longer holds a handshake slot."""
        if conn in self._handshaking:
            self._handshaking.discard(conn)
            ip = conn.remote_host or "?"
            left = self._handshakes_per_ip.get(ip, 1) - 1
            if left > 0:
                self._handshakes_per_ip[ip] = left
            else:
                self._handshakes_per_ip.pop(ip, None)

    def connection_ready(self, conn: Connection) -> None:
        self._handshake_over(conn)
        peer = conn.remote_peer
        assert peer is not None
        current = self._conns.get(peer)
        # Two peers dialing each other at once get two connections; both stay usable, and the
        # newest becomes the one used for outgoing calls.
        if current is None or current.is_closed or conn.initiator:
            self._conns[peer] = conn
        for callback in self.on_connect:
            callback(conn)

    def connection_closed(self, conn: Connection) -> None:
        self._all.discard(conn)
        self._handshake_over(conn)
        peer = conn.remote_peer
        if peer is not None and self._conns.get(peer) is conn:
            del self._conns[peer]
            for other in self._all:  # fall back to another open connection to the same peer
                if other.remote_peer == peer and other._send is not None:
                    self._conns[peer] = other
                    break
        if peer is not None and conn._send is not None and self.connection(peer) is None:
            for listener in list(self._disconnect_listeners):
                try:
                    listener(peer)
                except Exception:  # one listener's bug must not hide the event from the others
                    log.exception("disconnect listener failed")

    def on_disconnect(self, listener: Callable[[PeerID], None]) -> Callable[[], None]:
        """Call ``listener(peer)`` whenever the last open connection to ``peer`` closes (two
        peers can hold two connections after dialing each other at once: only losing both means
        the peer is gone). Returns a function that unsubscribes it."""
        self._disconnect_listeners.append(listener)

        def remove() -> None:
            if listener in self._disconnect_listeners:
                self._disconnect_listeners.remove(listener)
        return remove

    async def _watch(self) -> None:
        """Close connections that stall mid-frame (slow loris) or sit idle."""
        period = min(1.0, self.limits.frame_timeout / 4, self.limits.handshake_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self._all):
                if conn.partial_since is not None and now - conn.partial_since > self.limits.frame_timeout:
                    conn.close("peer stalled in the middle of a frame", abort=True)
                elif not conn.busy and now - conn.last_activity > self.limits.idle_timeout:
                    conn.close("idle")

    async def close(self) -> None:
        """Stop listening, close every connection and cancel every task this host owns."""
        if self._closed:
            return
        self._closed = True
        if self._relay_client is not None:
            await self._relay_client.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self._dialing.values()):
            task.cancel()
        conns = list(self._all)
        for conn in conns:
            conn.close("host closing")
        tasks = [t for c in conns for t in c._tasks]
        if self._watchdog is not None:
            tasks.append(self._watchdog)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self.pool.clear()
