"""One authenticated, encrypted connection to a peer (``Connection``): handshake, frames, RPC, streams.

An asyncio ``BufferedProtocol`` around the sans-IO ``mux.Mux``: bytes land in the mux's buffers (a
big frame straight into a buffer of the host's ``BufferPool``), the mux checks and decrypts each
frame once (big stream frames in place, in that buffer; others into fresh bytes) and the connection
dispatches the events it yields (where the host has a crypto pool, big stream frames are decrypted
there and dispatched in arrival order: ``dht.sealer``). RPC requests run as tasks owned by the connection (see
``rpc.RPCEndpoint``); bulk streams are ``stream.Stream`` objects. ``transport.Host`` creates
connections and owns what they share (the limits, the buffer pool, the handlers); see its module
for the rules on untrusted input.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from .aio import wait_event
from .errors import HandshakeError, MultiaddrError, PeerUnreachable, ProtocolError, RPCTimeout
from .identity import PeerID
from .multiaddr import Multiaddr, parse_circuits
from .mux import _HS_LEN, Frame, HandshakeMessage, Mux, Opening
from .noise import SwarmKeyMismatch, XXHandshake
from .pacing import SMALL_FRAME_COST, RequestPacer
from .rpc import RPCEndpoint
from .sealer import OrderedReceiver, OrderedSender
from .stream import COALESCE_BELOW, Stream
from .streamtable import StreamTable
from .tasks import TaskGroup
from .wire import HEADER_SIZE, LEGACY_FRAME_BODY, MAX_FRAME_BODY, TAG_SIZE, Kind, pack

if TYPE_CHECKING:
    from .transport import Host

log = logging.getLogger("dht.transport")  # (one logger for the transport layer, as before the split)

DEFAULT_PROLOGUE = b"p2ptrain/noise/1"
#: why a request or stream open over ``Limits.request_rate`` is refused
PACED = "busy: more requests than this peer serves per second"
#: stream data frames shorter than this (header and tag included) are paced (``dht.pacing``)
SMALL_DATA_FRAME = HEADER_SIZE + COALESCE_BELOW + TAG_SIZE

__all__ = ["DEFAULT_PROLOGUE", "Connection"]


class Connection(asyncio.BufferedProtocol, RPCEndpoint):
    """One secure connection. Created by ``Host``; use ``call`` and ``open_stream``."""

    def __init__(self, host: Host, initiator: bool, expected_peer: PeerID | None = None):
        self.host = host
        self.initiator = initiator
        self.expected_peer = expected_peer
        self.remote_peer: PeerID | None = None  # set once the handshake proves it
        self.remote_host: str | None = None
        self.remote_port: int | None = None  # the socket's (ephemeral) port, for log lines
        self.remote_listen_port: int | None = None
        #: the peer's circuit addresses, as it announced them (handshake, then ``host.addrs`` pushes)
        self.remote_relays: tuple[Multiaddr, ...] = ()
        self.remote_window = host.stream_window  # the peer's receive window per stream
        self.max_data_body = LEGACY_FRAME_BODY  # largest stream data frame the peer accepts
        self.ready: asyncio.Future[Connection] = host.loop.create_future()
        self._transport: asyncio.Transport | None = None
        # made once the host accepts the connection (connection_made): its ephemeral key costs
        # ~0.1 ms, which a flood of connections closed at once at the caps should not make us pay
        self._hs: XXHandshake = None  # type: ignore[assignment]
        self._hs_inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._calls: dict[int, asyncio.Future] = {}  # our requests awaiting their reply
        self._serving: dict[int, asyncio.Task] = {}  # the peer's requests being handled
        #: the open streams, ours and the peer's, and what they hold (``dht.streamtable``)
        self.streams = StreamTable(self)
        # (MAX_FRAME_BODY read now, not at import: an experiment of allreduce_bench lowers it)
        self._mux = Mux(initiator, host.pool, lambda: host.discard_buffer, self._stream_known,
                        max_body=MAX_FRAME_BODY)
        #: the tasks serving this connection (handshake, requests, streams): cancelled when it closes
        self._tasks = TaskGroup("connection", log=log, loop=host.loop)
        self._spawn = self._tasks.spawn
        self._write_ok = asyncio.Event()
        self._write_ok.set()
        # frames waiting for an earlier frame's encryption on the host's sealing pool (dht.sealer)
        self._outq = OrderedSender(host.loop, self._write_frame, self._seal_failed)
        # received frames waiting for an earlier big frame's decryption on that pool (dht.sealer)
        self._inq = OrderedReceiver(host.loop, self._deliver, self._input_failed, self._pause_for_pool)
        self._mux.defer_open = host.sealer is not None and host.limits.decrypt_on_pool
        #: ids of the peer's streams whose STREAM_OPEN waits in ``_inq``: their data is theirs, not dropped
        self._opens_waiting: set[int] = set()
        self._pool_paused = False  # reading stopped: too many frames wait for their decryption
        self._closed = False
        self.close_reason: str | None = None
        now = time.monotonic()
        self.last_activity = now
        self.partial_since: float | None = None
        self.opened_at = now
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pacer = RequestPacer(host.limits.request_burst, now)  # request_rate's bucket
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
            local_payload={**host.advertised(), "window": host.stream_window, "frame": MAX_FRAME_BODY},
            static=host.static_key,
            psk=host.swarm_key.secret if host.swarm_key is not None else None,
        )
        self._spawn(self._handshake())

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._mux.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        # Whatever a peer sends, only this connection can fail because of it.
        try:
            self.bytes_received += nbytes
            now = time.monotonic()
            self.last_activity = now
            for event in self._mux.receive(nbytes):
                if self._closed:
                    return
                if type(event) is Frame or type(event) is Opening:
                    self._on_event(event)
                elif type(event) is HandshakeMessage:
                    self._hs_inbox.put_nowait(event.data)
                else:  # Refused: handled here, not by the handshake task: the listener closes right
                    # after its refusal, and connection_lost would cancel the task before it read it
                    self._refuse(SwarmKeyMismatch(event.code, refused_by_peer=True,
                                                  have_key=self.host.swarm_key is not None))
            self.partial_since = (self.partial_since or now) if self._mux.partial else None
        except Exception as e:
            self._input_failed(e)

    def _input_failed(self, error: Exception) -> None:
        """What the peer sent broke the protocol (or a bug handling it did): only this connection ends."""
        if isinstance(error, ProtocolError):
            self.close(str(error), abort=True)
        else:  # a bug must not take the event loop down with it
            log.error("internal error on connection to %s", self.remote_peer, exc_info=error)
            self.close(f"internal error: {error!r}", abort=True)

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
        early = self._mux.start(hs.send_cipher, hs.recv_cipher)
        self.remote_peer = hs.remote_peer
        port = hs.remote_payload.get("port")
        self.remote_listen_port = port if isinstance(port, int) and 0 < port < 65536 else None
        self.set_remote_relays(hs.remote_payload.get("relays", []))
        window = hs.remote_payload.get("window")
        if isinstance(window, int) and 0 < window < 2**32:
            self.remote_window = window
        frame = hs.remote_payload.get("frame")
        if isinstance(frame, int) and not isinstance(frame, bool) and LEGACY_FRAME_BODY <= frame:
            self.max_data_body = min(frame, MAX_FRAME_BODY)
        self._hs = None  # type: ignore[assignment]  # drop ephemeral keys
        try:
            for event in early:
                self._on_event(event)
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

    # ------------------------------------------------------------------ frames in

    def _on_event(self, event: Frame | Opening) -> None:
        """A frame, opened or to be opened on the host's pool: acted on in arrival order."""
        if type(event) is Opening:
            pool = self.host.sealer
            if pool is not None:
                self._inq.open(pool, event.frame, event.job)
                return
            event.job()  # (the host is closing: its pool is gone)
            event = event.frame
        if self._inq:
            if event.kind == Kind.STREAM_OPEN:
                self._opens_waiting.add(event.ident)
            self._inq.push(event)
        else:
            self._on_frame(event)  # type: ignore[arg-type]

    def _stream_known(self, ident: int) -> bool:
        """Is stream ``ident`` open here, or will it be when this frame's turn comes (its open waits
        in ``_inq``)? Else the mux drops its data unread, so this must hold in arrival order."""
        return ident in self.streams or ident in self._opens_waiting

    def _deliver(self, frame: Frame) -> None:
        """A frame whose turn came after a decryption on the pool (``OrderedReceiver``)."""
        if frame.kind == Kind.STREAM_OPEN:
            self._opens_waiting.discard(frame.ident)
        if self._closed:
            return
        try:
            self._on_frame(frame)
        except Exception as e:
            self._input_failed(e)

    def _pause_for_pool(self, paused: bool) -> None:
        self._pool_paused = paused
        if self._closed or self._transport is None or self._transport.is_closing():
            return
        if paused:
            self._transport.pause_reading()
        elif self._throttled is None:  # (else _unthrottle resumes)
            self._transport.resume_reading()

    def _on_frame(self, frame: Frame) -> None:
        kind, ident, view, size = frame
        if kind == Kind.STREAM_DATA:
            if size < SMALL_DATA_FRAME:
                self._spend_request_token(SMALL_FRAME_COST)  # (taken all the same: paced by not reading on)
            if view is not None:  # (None: data for a stream not open here, dropped)
                self.streams.on_frame(kind, ident, view)
            return
        if kind == Kind.REQUEST:
            if self._spend_request_token():
                self._on_request(ident, view)
            else:  # frames of one read already in hand: refused cheaply, no handler runs
                self.post(Kind.ERROR, ident, pack(PACED))
        elif kind == Kind.RESPONSE or kind == Kind.ERROR:
            self._on_reply(kind, ident, view)
        elif kind == Kind.CANCEL:
            self._on_cancel(ident)
        elif kind == Kind.STREAM_OPEN:
            if self._spend_request_token():
                self.streams.open_inbound(ident, view)
            else:
                self.post(Kind.STREAM_RESET, ident, pack(PACED))
        elif kind == Kind.GOAWAY:  # a connection-level frame: its id names no stream
            self.close("peer is going away")
        else:
            self.streams.on_frame(kind, ident, view)

    def _spend_request_token(self, cost: float = 1.0) -> bool:
        """Account one request (or a frame that costs as much, see ``dht.pacing``) against
        ``Limits.request_rate``: False when the bucket is empty. Then the socket is left unread
        until a token is due, and the requests of the current read that are over the limit get a
        "busy" error (the caller may retry) instead of a handler."""
        limits = self.host.limits
        allowed, wait = self._pacer.spend(time.monotonic(), limits.request_rate, limits.request_burst, cost)
        if wait and self._throttled is None and self._transport is not None:
            # the bucket is empty: read this peer's next frame only once it has a token
            self.throttled_s += wait
            self._transport.pause_reading()
            self._throttled = self.host.loop.call_later(wait, self._unthrottle)
        return allowed

    def _unthrottle(self) -> None:
        self._throttled = None
        if self._closed or self._transport is None or self._transport.is_closing():
            return
        limits = self.host.limits
        wait = self._pacer.due(time.monotonic(), limits.request_rate, limits.request_burst)
        if wait:  # the rest of the read that paused us went into debt: wait that out too
            self.throttled_s += wait
            self._throttled = self.host.loop.call_later(wait, self._unthrottle)
        elif not self._pool_paused:  # (else the queue of frames being opened resumes it)
            self._transport.resume_reading()

    # ------------------------------------------------------------------ frames out

    def pack(self, obj: Any) -> bytes:
        return pack(obj)

    def send_frame(self, kind: Kind, ident: int, body: bytes | bytearray | memoryview = b"") -> None:
        """Encrypt ``body`` (read in place, never copied first) and hand the frame to the socket.

        Large frames are encrypted into a pooled buffer (see ``BufferPool``), small ones into a
        fresh ``bytes``; either goes out with the length/header prefix in one ``writelines``
        (after any frame still being sealed on the host's pool: see ``send_bulk``).
        """
        self._check_open()
        prefix, ciphertext = self._mux.seal(kind, ident, body)
        if self._outq:
            self._outq.push_ready(prefix, ciphertext)
        else:
            self._write_frame(prefix, ciphertext)
        if self._closed:
            raise PeerUnreachable(f"connection to {self.remote_peer} is closed") from None

    async def send_bulk(self, kind: Kind, ident: int, body: memoryview) -> None:
        """``send_frame`` for a big frame, sealed on the host's pool where it has one (many-core
        machines, see ``dht.sealer``) so the loop moves other frames meanwhile. Returns once
        ``body`` has been read: the caller may reuse it then."""
        pool = self.host.sealer
        self._check_open()
        sealed = self._mux.seal_job(kind, ident, body) if pool is not None else None
        if sealed is None:  # inline: no pool, or a frame too small (or too big) to pool
            self.send_frame(kind, ident, body)
            return
        prefix, ciphertext, job = sealed
        await self._outq.seal(pool, prefix, ciphertext, job)
        if self._closed:
            raise PeerUnreachable(f"connection to {self.remote_peer} is closed ({self.close_reason})")

    def _check_open(self) -> None:
        # uvloop raises RuntimeError on a write to a closing socket, before connection_lost runs.
        if self._closed or not self._mux.established or self._transport is None or self._transport.is_closing():
            raise PeerUnreachable(f"connection to {self.remote_peer} is closed ({self.close_reason})")

    def _write_frame(self, prefix: bytes, ciphertext: bytes | memoryview) -> None:
        """Hand one sealed frame to the socket (frames reach here in nonce order)."""
        if self._closed or self._transport is None:
            return
        try:
            self._transport.writelines((prefix, ciphertext))
        except RuntimeError:  # uvloop: the handle died under us (is_closing() can lag behind)
            self.close("connection lost", abort=True)
            return
        self.bytes_sent += len(prefix) + len(ciphertext)
        self.last_activity = time.monotonic()

    def _seal_failed(self, reason: str) -> None:
        if not self._closed:  # (a host closing cancels what it had queued: nothing to report)
            log.error("connection to %s: %s", self.remote_peer, reason)
            self.close(reason, abort=True)

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

    # ------------------------------------------------------------------ public API

    async def open_stream(self, protocol: str, header: Any = None) -> Stream:
        """Open a bulk stream served by the remote's handler for ``protocol``."""
        if len(self.streams) >= self.host.limits.max_streams:
            raise PeerUnreachable(f"too many open streams to {self.remote_peer}")
        ident = self._mux.new_id()
        stream = self.streams.add(ident, protocol, header)
        self.send_frame(Kind.STREAM_OPEN, ident, pack([protocol, header]))
        return stream

    def forget_stream(self, ident: int) -> None:
        self.streams.forget(ident)

    def set_remote_relays(self, obj: object) -> None:
        """Take the peer's announced circuit addresses (untrusted: malformed ones are ignored)."""
        assert self.remote_peer is not None
        try:
            self.remote_relays = parse_circuits(obj, self.remote_peer)
        except MultiaddrError as e:
            log.info("ignoring the relay addresses %s announced: %s", self.remote_peer, e)

    @property
    def established(self) -> bool:
        """The handshake completed (frames can be sent)."""
        return self._mux.established

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def busy(self) -> bool:
        return bool(self._calls or self._serving or self.streams)

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
        self._outq.clear()
        self._inq.clear()
        self._opens_waiting.clear()
        err = PeerUnreachable(f"connection to {self.remote_peer or self.remote_host} closed: {self.close_reason}")
        if not self.ready.done():
            self.ready.set_exception(HandshakeError(self.close_reason) if self.remote_peer is None else err)
            self.ready.exception()  # mark retrieved: a listener-side failure has no awaiter
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self.streams.reset_all(self.close_reason)
        self._tasks.cancel()
        if self._throttled is not None:
            self._throttled.cancel()
        self.host.connection_closed(self)

    async def aclose(self, reason: str = "closed") -> None:
        """``close`` and wait until every task serving this connection has ended."""
        self.close(reason)
        await self._tasks.close()
