"""Hostile peers: attacks on frames and streams (see the package docstring).

Each mode speaks the wire protocol correctly (a genuine, encrypted connection) and abuses what it
allows: frames too small to be worth their cost, streams it never ends, a body that decodes to far
more than its size; ``fake_swarmkey_refusal`` is not a peer at all, only the one byte a refusing
private peer sends. What the victim must hold stays within ``dht.Limits`` (tests count it through
the connection's stream accounting).
"""

from __future__ import annotations

import asyncio
from typing import Any

from dht import Connection, PeerUnreachable

from ._registry import mode

#: the wire's frame kind of stream data (dht.wire.Kind.STREAM_DATA): empty frames need a raw send,
#: ``Stream.write`` never makes one
STREAM_DATA = 6


@mode("tiny_frames", "open a stream and send its window as `frames` data frames of `size` bytes (0: empty frames), "
      "each costing the receiver a frame's work and, unless it coalesces them, a chunk object")
async def tiny_frames(conn: Connection, protocol: str, header: Any = None, *, frames: int, size: int = 1) -> Any:
    """Returns the stream (still open on our side; the victim may have reset it or dropped us)."""
    stream = await conn.open_stream(protocol, header)
    await send_tiny(conn, stream, frames, size)
    return stream


async def send_tiny(conn: Connection, stream: Any, frames: int, size: int = 1) -> None:
    """``frames`` data frames of ``size`` bytes on ``stream`` (0: empty frames, sent raw)."""
    piece = b"x" * size
    for i in range(frames):
        if size == 0:
            conn.send_frame(STREAM_DATA, stream.id, b"")  # type: ignore[arg-type]
        else:
            await stream.write(piece, timeout=10)
        if i % 1024 == 1023:  # a write that need not wait never yields: let the loop run
            await asyncio.sleep(0)


@mode("zombie_streams", "open `streams` streams, wait until their handler is done, then keep writing `data` bytes "
      "into each and never end them (a returned handler's stream used to stay open, queued and busy)")
async def zombie_streams(conn: Connection, protocol: str, header: Any = None, *, streams: int, data: int,
                         handler_done: asyncio.Event | None = None, piece: int = 16 << 10) -> int:
    """``handler_done`` (set by a test's handler): write only once the victim's handler returned.
    Returns the bytes the victim let us write before it reset the streams."""
    opened = [await conn.open_stream(protocol, header) for _ in range(streams)]
    if handler_done is not None:
        await handler_done.wait()
    junk, sent = bytes(piece), 0
    for stream in opened:
        try:
            for _ in range(0, data, piece):
                await stream.write(junk, timeout=10)
                sent += piece
        except PeerUnreachable:  # (StreamReset is one) the victim reset the stream: next one
            continue
    return sent


@mode("msgpack_bomb", "call `method` with a body of about `size` bytes of empty maps, which decoded "
      "naively take ~72 bytes of Python objects per byte")
async def msgpack_bomb(conn: Connection, method: str = "find_node", *, size: int = (1 << 20) - 1024,
                       timeout: float = 10.0) -> Any:
    """Returns what the victim answered (or raises: it should drop the connection)."""
    return await conn.call(method, bomb_body(size), timeout=timeout)


def bomb_body(size: int = (1 << 20) - 1024) -> list:
    """The object ``msgpack_bomb`` sends: lists of empty maps, each list under the decoder's
    per-container cap, about ``size`` bytes packed."""
    per = 60_000
    return [[{}] * per for _ in range(max(1, size // (per + 5)))]


@mode("fake_swarmkey_refusal", "listen and answer every dialer's first handshake message with the one-byte "
      "swarm-key refusal `code` (1: you need a key, 2: keys differ, 3: this swarm is public): "
      "unauthenticated, so anyone at an address can say it")
async def fake_swarmkey_refusal(code: int = 3, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """A started server (close it when done; its port: ``server.sockets[0].getsockname()[1]``)."""

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            n = int.from_bytes(await reader.readexactly(2), "big")  # message 1: u16 length, then it
            await reader.readexactly(n)
            writer.write(b"\x00\x01" + bytes([code]))  # a handshake message of one byte: a refusal
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(refuse, host, port)
