"""The sans-IO multiplexer (dht.mux): bytes in, events out, with no socket or event loop."""

from __future__ import annotations

import struct

import pytest

from dht.bufpool import BufferPool
from dht.errors import ProtocolError
from dht.identity import Identity
from dht.mux import HandshakeMessage, Mux, Refused
from dht.noise import XXHandshake
from dht.wire import MAX_FRAME, MAX_FRAME_BODY, Kind, pack

A, B = Identity(), Identity()
OPEN_STREAM = 7


def make(initiator: bool) -> Mux:
    return Mux(initiator, BufferPool(MAX_FRAME, keep=4), lambda: memoryview(bytearray(MAX_FRAME_BODY)),
               lambda ident: ident == OPEN_STREAM)


def feed(mux: Mux, data: bytes, chunk: int = 1000) -> list:
    """Write ``data`` the way asyncio does: at most what ``get_buffer`` offers, ``chunk`` at a time."""
    events, data = [], memoryview(data)
    while data:
        buf = mux.get_buffer()
        n = min(len(buf), len(data), chunk)
        buf[:n] = data[:n]
        events.extend(mux.receive(n))
        data = data[n:]
    return events


def hs(message: bytes) -> bytes:
    return struct.pack(">H", len(message)) + message


def sealed(mux: Mux, kind: Kind, ident: int, body: bytes) -> bytes:
    prefix, ciphertext = mux.seal(kind, ident, body)
    return prefix + bytes(ciphertext)




def test_handshake_messages_then_frames_in_both_directions() -> None:
    dialer, listener = make(True), make(False)
    hi, hr = XXHandshake(A, True, local_payload={}), XXHandshake(B, False, local_payload={})
    m1 = hi.write_message()
    assert feed(listener, hs(m1), chunk=3) == [HandshakeMessage(m1)]
    hr.read_message(m1)
    (m2,) = feed(dialer, hs(hr.write_message()))
    hi.read_message(m2.data)
    m3 = hi.write_message()
    dialer_early = dialer.start(hi.send_cipher, hi.recv_cipher)
    assert list(dialer_early) == []
    # the dialer's first frame shares the packet of its last handshake message
    request = sealed(dialer, Kind.REQUEST, dialer.new_id(), pack(["ping", None]))
    events = feed(listener, hs(m3) + request)
    assert events == [HandshakeMessage(m3)]
    hr.read_message(m3)
    (early,) = list(listener.start(hr.send_cipher, hr.recv_cipher))
    assert (early.kind, early.ident, bytes(early.body)) == (Kind.REQUEST, 1, pack(["ping", None]))
    assert dialer.new_id() == 3 and listener.new_id() == 2

    big = bytes(range(256)) * 4096  # 1 MiB: sealed into and opened in pooled buffers
    (frame,) = feed(dialer, sealed(listener, Kind.STREAM_DATA, OPEN_STREAM, big), chunk=1 << 16)
    assert frame.kind == Kind.STREAM_DATA and frame.body.readonly and bytes(frame.body) == big
    (dropped,) = feed(dialer, sealed(listener, Kind.STREAM_DATA, 9, b"late data"))
    assert dropped.body is None and dropped.ident == 9  # authenticated, dropped unread
    assert not dialer.partial


def test_a_refusal_is_an_event_for_the_dialer() -> None:
    dialer = make(True)
    assert feed(dialer, hs(bytes([2]))) == [Refused(2)]


def established() -> tuple[Mux, Mux]:
    """A dialer and a listener whose handshake ran through them."""
    dialer, listener = make(True), make(False)
    hi, hr = XXHandshake(A, True, local_payload={}), XXHandshake(B, False, local_payload={})
    (m1,) = feed(listener, hs(hi.write_message()))
    hr.read_message(m1.data)
    (m2,) = feed(dialer, hs(hr.write_message()))
    hi.read_message(m2.data)
    (m3,) = feed(listener, hs(hi.write_message()))
    hr.read_message(m3.data)
    assert list(dialer.start(hi.send_cipher, hi.recv_cipher)) == []
    assert list(listener.start(hr.send_cipher, hr.recv_cipher)) == []
    return dialer, listener


@pytest.mark.parametrize("kind, body, match", [
    (Kind.STREAM_DATA, b"", "empty stream data frame"),
    (Kind.RESPONSE, b"x" * (MAX_FRAME_BODY // 2), "message limit"),
])
def test_frames_the_peer_must_not_send_raise_protocol_error(kind: Kind, body: bytes, match: str) -> None:
    dialer, listener = established()
    assert dialer.established and listener.established
    with pytest.raises(ProtocolError, match=match):
        feed(listener, sealed(dialer, kind, OPEN_STREAM, body), chunk=1 << 20)
