"""The connection's multiplexer, sans-IO (h11-style): bytes in, events out; frames out as bytes.

``Mux`` turns what the socket delivered into events: the peer's handshake messages (or its
refusal), then authenticated, decrypted frames. It checks each frame against the wire limits and
decrypts big stream frames in place (pooled buffers, ``dht.bufpool``), or leaves that to the caller
(``defer_open``: an ``Opening`` event, decrypted on a thread pool by ``connection``). On the way out it seals
frames (header, encryption, length prefix) for the caller to write. It owns no socket, task or
timer: ``connection.Connection`` is the asyncio shell that feeds it and acts on its events.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from .bufpool import POOLED_FRAME_MIN, BufferPool
from .errors import HandshakeError, PeerUnreachable, ProtocolError
from .noise import REFUSAL_SIZE, CipherState
from .wire import (
    HEADER_SIZE,
    LENGTH,
    MAX_CONTROL_FRAME,
    MAX_FRAME_BODY,
    MAX_HANDSHAKE_FRAME,
    MAX_MESSAGE,
    TAG_SIZE,
    FrameReader,
    Kind,
    pack_header,
    parse_header,
)

_HS_LEN = struct.Struct(">H")  # the length prefix of a handshake message
#: frames the peer may send before our side of the handshake completes
_MAX_EARLY_FRAMES = 16


class HandshakeMessage(NamedTuple):
    """One complete handshake message from the peer."""

    data: bytes


class Refused(NamedTuple):
    """The peer (a listener) refused our handshake: another swarm; ``code`` says why."""

    code: int


class Frame(NamedTuple):
    """An authenticated frame. ``body`` is its plaintext, read-only; None for stream data of a
    stream not open here (authenticated, then dropped unread). ``size``: its bytes on the wire,
    header and tag included (the shell paces small data frames)."""

    kind: int
    ident: int
    body: memoryview | None
    size: int


class Opening(NamedTuple):
    """A big stream frame whose decryption is left to the caller: ``job()`` (any thread) decrypts
    it into ``frame.body``, or raises ProtocolError on a bad tag. Its nonce is already taken: the
    frames after it must reach the connection's protocol only after it (``dht.sealer``)."""

    frame: Frame
    job: Callable[[], None]


Event = HandshakeMessage | Refused | Frame | Opening


class Mux:
    """One connection's framing and encryption state; ``has_stream(ident)``: is that stream open,
    or will it be by the frame's turn (decrypted elsewhere, frames reach the caller's streams later)."""

    def __init__(self, initiator: bool, pool: BufferPool, scratch: Callable[[], memoryview],
                 has_stream: Callable[[int], bool], max_body: int = MAX_FRAME_BODY):
        self.initiator = initiator
        self.max_body = max_body  # largest stream data body we seal in a pooled buffer or accept to drop
        #: big stream frames come out as ``Opening`` (decrypted by the caller, e.g. on a pool), not ``Frame``
        self.defer_open = False
        self._pool = pool
        self._scratch = scratch  # where dropped frames are decrypted (one buffer, reused)
        self._has_stream = has_stream
        self._hs_expected = 1 if initiator else 2  # handshake messages still to come from the peer
        self._hs_buf = bytearray()
        self._hs_chunk = bytearray(0)
        self._early_frames: list[bytes] = []
        self._reader = FrameReader(alloc=pool.get if pool.keep else None)
        self._send: CipherState | None = None
        self._recv: CipherState | None = None
        self._next_id = 1 if initiator else 2  # odd ids for the dialer, even for the listener

    # ------------------------------------------------------------------ bytes in

    @property
    def established(self) -> bool:
        """The handshake completed: frames can be sealed and opened."""
        return self._send is not None

    @property
    def partial(self) -> bool:
        """A frame has been started but not finished (used to catch slow-loris peers)."""
        return self._reader.partial

    def get_buffer(self) -> memoryview:
        """Where the socket should write the next bytes (``BufferedProtocol.get_buffer``)."""
        if self._hs_expected:
            self._hs_chunk = bytearray(MAX_HANDSHAKE_FRAME + 2)
            return memoryview(self._hs_chunk)
        return self._reader.get_buffer()

    def receive(self, nbytes: int) -> Iterable[Event]:
        """The events of ``nbytes`` just written into ``get_buffer()``, checked and decrypted one
        by one as they are iterated; raises ProtocolError (HandshakeError during the handshake)
        for anything the peer must not send."""
        if self._hs_expected:
            # The last handshake message may share a packet with the start of a frame.
            return self._handshake_bytes(memoryview(self._hs_chunk)[:nbytes])
        frames = self._reader.buffer_updated(nbytes)
        return self._opened(frames) if frames else ()  # (most reads only fill part of a big frame)

    def _opened(self, frames: Iterable[memoryview]) -> Iterator[Frame | Opening]:
        for frame in frames:
            event = self._open(frame)
            if event is not None:
                yield event

    def start(self, send: CipherState, recv: CipherState) -> Iterator[Frame | Opening]:
        """The handshake is done: use these ciphers; the frames that arrived before it follow."""
        self._send, self._recv = send, recv
        early, self._early_frames = self._early_frames, []
        return self._opened(memoryview(raw) for raw in early)

    def _handshake_bytes(self, data: memoryview) -> Iterator[Event]:
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
                yield Refused(self._hs_buf[2])
                return
            message = bytes(self._hs_buf[2 : 2 + n])
            del self._hs_buf[: 2 + n]
            self._hs_expected -= 1
            yield HandshakeMessage(message)
        if not self._hs_expected and self._hs_buf:
            rest, self._hs_buf = bytes(self._hs_buf), bytearray()
            self._early_frames.extend(self._reader.feed(rest))

    def _open(self, frame: memoryview) -> Frame | Opening | None:
        """Check and decrypt one frame (header + ciphertext); None while the handshake is running
        (the frame waits for ``start``). With ``defer_open``, a big frame of an open stream comes
        back undecrypted, as an ``Opening``."""
        recv = self._recv
        if recv is None:
            if len(self._early_frames) >= _MAX_EARLY_FRAMES:
                raise ProtocolError("too many frames before the handshake completed")
            self._early_frames.append(bytes(frame))
            return None
        header = bytes(frame[:HEADER_SIZE])
        kind, _flags, ident = parse_header(header)
        size = len(frame)
        if size < HEADER_SIZE + TAG_SIZE:
            raise ProtocolError("frame shorter than its authentication tag")
        if size > MAX_CONTROL_FRAME and kind != Kind.STREAM_DATA:
            raise ProtocolError(f"frame of kind {kind} exceeds the {MAX_MESSAGE}-byte message limit")
        if kind == Kind.STREAM_DATA:
            if size == HEADER_SIZE + TAG_SIZE:
                # it would cost us a chunk object and count nothing against the window; no sender of
                # ours writes one
                raise ProtocolError("empty stream data frame")
            if not self._has_stream(ident):
                # Data for a stream we reset or never had (it was in flight when the reset left, or
                # the peer ignores resets): authenticated, then dropped. Decrypted into one reusable
                # scratch buffer, not a fresh one per frame: a peer pushing data into refused streams
                # otherwise makes us allocate (and the allocator keep) hundreds of MB a second.
                n = size - HEADER_SIZE - TAG_SIZE
                if n > self.max_body:
                    raise ProtocolError("stream data frame larger than the frame limit")
                recv.decrypt_into(header, frame[HEADER_SIZE:], self._scratch()[:n])
                return Frame(kind, ident, None, size)
            if size >= POOLED_FRAME_MIN and self._pool.keep:
                # Decrypted in place where the frame has a (pooled) buffer of its own, else into a
                # pooled buffer; handed on read-only, and never reused while viewed. In place: one
                # buffer per frame in flight, not two, and its plaintext is written where the
                # ciphertext was just read (still cached), not into another, cold buffer.
                n = size - HEADER_SIZE - TAG_SIZE
                view = frame[HEADER_SIZE : HEADER_SIZE + n] if not frame.readonly else memoryview(self._pool.get(n))[:n]
                if self.defer_open and len(view.obj) <= 2 * size:  # type: ignore[arg-type]
                    return Opening(Frame(kind, ident, view.toreadonly(), size),
                                   recv.decrypt_job(header, frame[HEADER_SIZE:], view))
                recv.decrypt_into(header, frame[HEADER_SIZE:], view)
                view = view.toreadonly()
                if len(view.obj) > 2 * size:  # a queued frame holds at most twice its frame (Limits):
                    view = memoryview(bytes(view))  # the pool sees to it; a buffer of any other origin is copied
                return Frame(kind, ident, view, size)
        return Frame(kind, ident, memoryview(recv.decrypt(header, frame[HEADER_SIZE:])), size)  # fresh, read-only

    # ------------------------------------------------------------------ bytes out

    def new_id(self) -> int:
        """A fresh request/stream id of our parity; PeerUnreachable once the id space is spent."""
        ident = self._next_id
        self._next_id += 2
        if self._next_id >= 2**32:
            raise PeerUnreachable("id space exhausted on this connection; reconnect")
        return ident

    def seal(self, kind: Kind, ident: int, body: bytes | bytearray | memoryview) -> tuple[bytes, Any]:
        """``(prefix, ciphertext)`` of one frame: ``body`` encrypted (read in place, never copied
        first) into a pooled buffer when large, into fresh bytes when small."""
        header = pack_header(kind, ident)
        ciphertext = self._pooled_ciphertext(len(body) if type(body) is not memoryview else body.nbytes)
        if ciphertext is not None:
            self._send.encrypt_into(header, body, ciphertext)  # type: ignore[union-attr]
        else:
            ciphertext = self._send.encrypt(header, body)  # type: ignore[union-attr]
        return LENGTH.pack(HEADER_SIZE + len(ciphertext)) + header, ciphertext

    def seal_job(self, kind: Kind, ident: int, body: memoryview) -> tuple[bytes, memoryview, Any] | None:
        """``(prefix, ciphertext, job)`` for a frame to be encrypted elsewhere (``job``, see
        ``dht.sealer``); None when the frame is too small or too big for a pooled buffer."""
        ciphertext = self._pooled_ciphertext(body.nbytes)
        if ciphertext is None:
            return None
        header = pack_header(kind, ident)
        job = self._send.encrypt_job(header, body, ciphertext)  # type: ignore[union-attr]
        return LENGTH.pack(HEADER_SIZE + len(ciphertext)) + header, ciphertext, job

    def _pooled_ciphertext(self, n: int) -> memoryview | None:
        """A pooled buffer for the ciphertext of an ``n``-byte body, reused only after the
        transport has let go of it; None for frames too small or too big to pool."""
        if n + TAG_SIZE >= POOLED_FRAME_MIN and n <= self.max_body and self._pool.keep:
            return memoryview(self._pool.get(n + TAG_SIZE))[: n + TAG_SIZE]
        return None
