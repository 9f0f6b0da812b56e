"""Wire format: frame layout, the sans-IO frame reader, and the msgpack codec with limits.

After the handshake every frame on a connection is::

    u32 length (big-endian, of what follows) | header (8 bytes) | AES-GCM ciphertext of the body + tag

The header (frame kind, flags, stream/call id) is sent in clear but authenticated as AEAD associated
data, which lets a tensor chunk be encrypted straight from the caller's buffer into the socket
buffer with no concatenation copy. Bodies are msgpack for RPC and raw bytes for bulk streams.

Limits: msgpack bodies (every kind but STREAM_DATA) are at most ``MAX_MESSAGE`` (1 MiB), a stream's
open (held while the stream lives) ``MAX_STREAM_HEADER``, and what a body decodes to is bounded
too (see ``unpack``: 1 MiB of empty maps was 72 MiB of Python objects); stream
data frames at most ``MAX_FRAME_BODY`` (4 MiB), as each side announces in its handshake payload
(``"frame"``; a peer that announces nothing gets ``LEGACY_FRAME_BODY`` = 1 MiB frames). Fewer,
larger frames cut the per-frame Python work, and a 1M-float tensor chunk fits one frame, so the
receiver reads it as one zero-copy view.

``FrameReader`` follows asyncio's BufferedProtocol contract (``get_buffer``/``buffer_updated``) but
owns no socket: small frames are parsed out of one reusable buffer, large ones are received straight
into a reused buffer, so a 4 MiB tensor chunk is copied once from the kernel and once by the
decryption. The declared length is checked against the limit *before* anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable
import enum
import struct
import sys
from typing import Any

import msgpack

from .errors import ProtocolError

LENGTH = struct.Struct(">I")
HEADER = struct.Struct(">BBHI")  # kind, flags, reserved, id
HEADER_SIZE = HEADER.size
TAG_SIZE = 16
MAX_MESSAGE = 1 << 20  # msgpack bodies (RPC, stream open, reset, goaway): 1 MiB of plaintext
MAX_FRAME_BODY = 4 << 20  # stream data: 4 MiB of plaintext per frame (a 1M-float chunk in one frame)
#: what a peer that does not advertise its frame limit in the handshake accepts (protocol 1.0)
LEGACY_FRAME_BODY = 1 << 20
MAX_FRAME = HEADER_SIZE + MAX_FRAME_BODY + TAG_SIZE
MAX_CONTROL_FRAME = HEADER_SIZE + MAX_MESSAGE + TAG_SIZE  # every kind but STREAM_DATA
MAX_HANDSHAKE_FRAME = 4096
#: a STREAM_OPEN body (protocol and header): the header is held as long as the stream is open
MAX_STREAM_HEADER = 16 << 10
#: ``unpack``'s bound on what a body decodes to: its containers (lists and maps, by
#: ``sys.getsizeof``) may take DECODED_PER_BYTE bytes per body byte, plus DECODED_SLACK (so any
#: DHT value of up to 64 KiB decodes, whatever its shape). Each scalar sits in a container slot
#: those count, so a 1 MiB body decodes to at most ~28 MiB.
DECODED_PER_BYTE = 4
DECODED_SLACK = 512 << 10
#: bodies up to this size are decoded without the container count (at most ~72x: 288 KiB)
_UNCOUNTED = 4096


class Kind(enum.IntEnum):
    REQUEST = 1  # body: msgpack [method, args]
    RESPONSE = 2  # body: msgpack result
    ERROR = 3  # body: msgpack str (reason)
    CANCEL = 4  # no body: the caller gave up on call `id`
    STREAM_OPEN = 5  # body: msgpack [protocol, header]
    STREAM_DATA = 6  # body: raw bytes
    STREAM_END = 7  # no body: the sender will write no more on stream `id`
    STREAM_RESET = 8  # body: msgpack str (reason); both directions are dead
    WINDOW = 9  # body: u32 credit in bytes the receiver grants the sender on stream `id`
    GOAWAY = 10  # body: msgpack str; the sender is closing the connection


_KINDS = frozenset(int(k) for k in Kind)


def parse_header(header: bytes | memoryview) -> tuple[int, int, int]:
    kind, flags, _reserved, ident = HEADER.unpack(header)
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    return kind, flags, ident  # the int: constructing the enum per frame is measurable


def pack_header(kind: Kind, ident: int, flags: int = 0) -> bytes:
    return HEADER.pack(kind, flags, 0, ident)


# ---------------------------------------------------------------- msgpack with hard limits

def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class _TooManyObjects(Exception):
    pass


def unpack(data: bytes | memoryview, max_size: int = MAX_MESSAGE) -> Any:
    """Decode a msgpack body from an untrusted peer; any failure is a ProtocolError.

    What it decodes to is bounded, not only its size: no container may claim more elements than
    the body has bytes (msgpack allocates a list for what its header claims), and the containers'
    memory, summed, may not pass ``DECODED_PER_BYTE`` per body byte (+ ``DECODED_SLACK``): many
    tiny containers cost ~72 bytes each for 1 byte of body."""
    n = len(data)
    if n > max_size:
        raise ProtocolError(f"message of {n} bytes exceeds the {max_size}-byte limit")
    hooks: dict[str, Any] = {}
    if n > _UNCOUNTED:
        budget = DECODED_PER_BYTE * n + DECODED_SLACK

        def count(obj: Any, size: Callable[[Any], int] = sys.getsizeof) -> Any:
            nonlocal budget
            budget -= size(obj)
            if budget < 0:
                raise _TooManyObjects
            return obj

        hooks = {"list_hook": count, "object_hook": count}
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            max_str_len=max_size,
            max_bin_len=max_size,
            max_array_len=min(100_000, n),
            max_map_len=min(100_000, n),
            max_ext_len=0,
            **hooks,
        )
    except _TooManyObjects:
        raise ProtocolError(f"message of {n} bytes decodes to more than {DECODED_PER_BYTE * n + DECODED_SLACK} "
                            "bytes of lists and maps") from None
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"malformed message: {type(e).__name__}") from None


# ---------------------------------------------------------------- sans-IO frame reader

class FrameReader:
    """Reassembles length-prefixed frames from a byte stream, BufferedProtocol-style.

    ``get_buffer()`` returns where the next bytes should be written; ``buffer_updated(n)`` records
    that ``n`` bytes were written there and returns the frames completed so far, each as a
    memoryview over ``length`` bytes (header + ciphertext). Views stay valid until the next call.
    ``feed(data)`` is a convenience for tests and fuzzers.
    """

    def __init__(self, max_frame: int = MAX_FRAME, small_size: int = 64 * 1024,
                 alloc: Callable[[int], bytearray] | None = None):
        self.max_frame = max_frame
        self._small = bytearray(small_size)
        self._start = 0  # first unparsed byte in _small
        self._end = 0  # end of valid data in _small
        self._big: memoryview | None = None  # view of the buffer the large frame is received into
        # ``alloc(n)``: where large frames are received (a pool shared by every connection, which
        # hands a buffer out again once nothing references it). Without one, one buffer of our own
        # is reused across large frames: kept for the connection's life, so a peer that has
        # exchanged tensors with a hundred others would hold a hundred idle multi-MiB buffers.
        self._alloc = alloc if alloc is not None else self._own_buffer
        self._big_buf = bytearray(0)
        self._big_fill = 0

    def _own_buffer(self, n: int) -> bytearray:
        if len(self._big_buf) < n:  # grown on demand: most connections carry only RPC
            self._big_buf = bytearray(max(n, 2 * len(self._big_buf)))
        return self._big_buf

    @property
    def partial(self) -> bool:
        """True while a frame has been started but not finished (used to catch slow-loris peers)."""
        return self._big is not None or self._end > self._start

    def get_buffer(self) -> memoryview:
        if self._big is not None:
            return self._big[self._big_fill :]
        if self._end == len(self._small):  # full: compact the partial frame to the front
            self._compact()
        return memoryview(self._small)[self._end :]

    def _compact(self) -> None:
        n = self._end - self._start
        self._small[:n] = self._small[self._start : self._end]
        self._start, self._end = 0, n

    def buffer_updated(self, nbytes: int) -> list[memoryview]:
        if self._big is not None:
            self._big_fill += nbytes
            if self._big_fill < len(self._big):
                return []
            frame = self._big
            self._big, self._big_fill = None, 0
            return [frame]
        self._end += nbytes
        frames: list[memoryview] = []
        view = memoryview(self._small)
        while self._end - self._start >= LENGTH.size:
            (length,) = LENGTH.unpack_from(self._small, self._start)
            if length < HEADER_SIZE or length > self.max_frame:
                raise ProtocolError(f"frame length {length} outside [{HEADER_SIZE}, {self.max_frame}]")
            total = LENGTH.size + length
            available = self._end - self._start
            if available >= total:
                # Copy out: the small buffer is reused as soon as we return.
                frames.append(memoryview(bytes(view[self._start + LENGTH.size : self._start + total])))
                self._start += total
                continue
            if total > len(self._small) // 2:
                # A large frame: receive the rest straight into a buffer of its exact size (with a
                # pool, the view we hand out is the only reference we keep)
                self._big = memoryview(self._alloc(length))[:length]
                got = available - LENGTH.size
                self._big[:got] = view[self._start + LENGTH.size : self._end]
                self._big_fill = got
                self._start = self._end = 0
            break
        if self._start == self._end:
            self._start = self._end = 0
        elif self._big is None and len(self._small) - self._end < 16 * 1024:
            self._compact()
        return frames

    def feed(self, data: bytes) -> list[bytes]:
        """Push ``data`` through get_buffer/buffer_updated (for tests and fuzzing)."""
        frames: list[bytes] = []
        data = memoryview(data)
        while data:
            buf = self.get_buffer()
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            data = data[n:]
            frames.extend(bytes(f) for f in self.buffer_updated(n))
        return frames
