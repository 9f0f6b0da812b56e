"""Wire format: the sans-IO FrameReader and the msgpack codec with limits."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.errors import ProtocolError
from dht.wire import (
    HEADER_SIZE,
    LENGTH,
    MAX_FRAME,
    MAX_FRAME_BODY,
    FrameReader,
    Kind,
    pack,
    pack_header,
    parse_header,
    unpack,
)


def frame(payload: bytes) -> bytes:
    """A length-prefixed frame; the reader only cares that the payload holds a header's worth."""
    assert len(payload) >= HEADER_SIZE
    return LENGTH.pack(len(payload)) + payload


def payload_of(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def feed_in_chunks(reader: FrameReader, data: bytes, cuts: list[int]) -> list[bytes]:
    out: list[bytes] = []
    prev = 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]:
        out.extend(reader.feed(data[prev:cut]))
        prev = cut
    return out


def drive_with_buffer_protocol(reader: FrameReader, data: bytes, chunk_sizes) -> list[bytes]:
    """Feed like asyncio does: write at most len(get_buffer()) bytes per buffer_updated call."""
    out: list[bytes] = []
    pos = 0
    sizes = iter(chunk_sizes)
    while pos < len(data):
        buf = reader.get_buffer()
        assert len(buf) > 0
        n = min(len(buf), next(sizes, 1 << 30), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        pos += n
        out.extend(bytes(f) for f in reader.buffer_updated(n))
    return out


# ------------------------------------------------------------------ header and codec

def test_header_round_trip():
    header = pack_header(Kind.STREAM_DATA, 0xDEADBEEF, flags=3)
    assert len(header) == HEADER_SIZE
    assert parse_header(header) == (Kind.STREAM_DATA, 3, 0xDEADBEEF)
    assert parse_header(memoryview(header)) == (Kind.STREAM_DATA, 3, 0xDEADBEEF)


@pytest.mark.parametrize("kind", [0, 11, 255])
def test_unknown_kind_is_protocol_error(kind):
    with pytest.raises(ProtocolError, match=f"unknown frame kind {kind}"):
        parse_header(bytes([kind]) + b"\x00" * 7)


def test_pack_unpack_round_trip():
    obj = ["method", {"key": b"\x00\xff", "n": 3, "nested": [1.5, None, True, "text"]}]
    assert unpack(pack(obj)) == obj
    assert unpack(memoryview(pack(obj))) == obj


def test_unpack_limits():
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(pack(b"x" * 100), max_size=50)
    with pytest.raises(ProtocolError):
        unpack(pack(list(range(100_001))), max_size=10 << 20)  # array too long
    with pytest.raises(ProtocolError):
        unpack(b"\xd4\x01\x00")  # ext type: disabled
    with pytest.raises(ProtocolError):
        unpack(pack(1) + pack(2))  # trailing data
    with pytest.raises(ProtocolError):
        unpack(b"")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_unpack_arbitrary_bytes_raises_only_protocol_error(data):
    try:
        unpack(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64))
def test_unpack_claimed_huge_container_does_not_allocate(prefix):
    # array32 / map32 / bin32 / str32 headers declaring ~4 G elements, followed by random bytes
    for marker in (b"\xdd", b"\xdf", b"\xc6", b"\xdb"):
        try:
            unpack(marker + b"\xff\xff\xff\xf0" + prefix)
        except ProtocolError:
            pass


# ------------------------------------------------------------------ FrameReader

def test_single_frame_all_at_once():
    reader = FrameReader()
    p = payload_of(100, 1)
    assert reader.feed(frame(p)) == [p]
    assert not reader.partial


def test_byte_by_byte():
    payloads = [payload_of(n, n) for n in (HEADER_SIZE, 9, 100, 4000, 40_000)]
    data = b"".join(frame(p) for p in payloads)
    ends = set()
    pos = 0
    for p in payloads:
        pos += LENGTH.size + len(p)
        ends.add(pos)
    reader = FrameReader()
    out: list[bytes] = []
    for i in range(len(data)):
        out.extend(reader.feed(data[i : i + 1]))
        assert reader.partial == (i + 1 not in ends)
    assert out == payloads
    assert not reader.partial


def test_small_and_large_interleaved():
    # > 32 KiB frames take the big-buffer path (default small buffer 64 KiB); 1 MiB frames too
    sizes = [10, 40_000, 8, 1 << 20, 33_000, 200, MAX_FRAME - 4, 12, 70_000, 16]
    sizes = [max(s, HEADER_SIZE) for s in sizes]
    payloads = [payload_of(n, i) for i, n in enumerate(sizes)]
    data = b"".join(frame(p) for p in payloads)
    reader = FrameReader()
    assert reader.feed(data) == payloads
    rng = random.Random(7)
    for _ in range(5):
        reader = FrameReader()
        cuts = [rng.randrange(len(data)) for _ in range(rng.randrange(1, 200))]
        assert feed_in_chunks(reader, data, cuts) == payloads


def test_large_frames_with_a_shared_pool_are_intact_and_hold_no_buffer_after():
    """With ``alloc`` (the host's frame pool), large frames are received into pool buffers, and
    the view handed out is the reader's only hold on one: once the caller drops the frame the
    buffer is reusable, so an idle connection keeps no multi-MiB buffer of its own."""
    from dht.bufpool import BufferPool

    sizes = [10, 40_000, 1 << 20, 33_000, MAX_FRAME - 4, 12, 300_000]
    payloads = [payload_of(n, i) for i, n in enumerate(sizes)]
    data = b"".join(frame(p) for p in payloads)
    pool = BufferPool(MAX_FRAME, keep=4)
    rng = random.Random(3)
    for _ in range(3):
        reader = FrameReader(alloc=pool.get)
        cuts = [rng.randrange(len(data)) for _ in range(rng.randrange(1, 100))]
        assert feed_in_chunks(reader, data, cuts) == payloads
        assert not reader.partial
    # 3 x 5 large frames went through (40 kB and 33 kB ones too, when a cut leaves them
    # incomplete in the small buffer): at most one buffer per size class (64 KiB, 320 KiB, 1 MiB,
    # 4 MiB), each handed back when its frame was dropped and taken by the next of its size
    assert 3 <= len(pool._bufs) <= 4
    # the reader is still alive (an idle connection) and holds none of them
    assert all(pool._refs(i) <= pool._idle_refs for i in range(len(pool._bufs)))


def test_buffer_protocol_with_limited_writes():
    payloads = [payload_of(n, n) for n in (20, 50_000, 30, 100_000, 8, 65_536, 65_535 - 4, 9)]
    data = b"".join(frame(p) for p in payloads)
    for chunk in (7, 4096, 65_536, 1 << 20):
        assert drive_with_buffer_protocol(FrameReader(), data, iter(lambda c=chunk: c, None)) == payloads


def test_views_are_copies_for_small_frames():
    # small frames are handed out as copies: they stay valid after the reader reuses its buffer
    reader = FrameReader()
    first = reader.buffer_updated(0)
    assert first == []
    a, b = payload_of(50, 1), payload_of(50, 2)
    buf = reader.get_buffer()
    buf[: len(frame(a))] = frame(a)
    (view,) = reader.buffer_updated(len(frame(a)))
    buf = reader.get_buffer()
    buf[: len(frame(b))] = frame(b)
    reader.buffer_updated(len(frame(b)))
    assert bytes(view) == a


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(
        st.one_of(st.integers(HEADER_SIZE, 300), st.integers(30_000, 140_000)), min_size=1, max_size=8
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=2_000_000), max_size=60),
    small_size=st.sampled_from([64, 1024, 64 * 1024]),
)
def test_random_splits(sizes, cuts, small_size):
    payloads = [payload_of(n, i) for i, n in enumerate(sizes)]
    data = b"".join(frame(p) for p in payloads)
    reader = FrameReader(small_size=small_size)
    cuts = [c % (len(data) + 1) for c in cuts]
    assert feed_in_chunks(reader, data, cuts) == payloads
    assert not reader.partial


@pytest.mark.parametrize("length", [2**31, 2**32 - 1, MAX_FRAME + 1])
def test_oversized_length_rejected_before_allocating(length):
    reader = FrameReader()
    with pytest.raises(ProtocolError, match=str(length)):
        reader.feed(LENGTH.pack(length))
    assert len(reader._big_buf) == 0  # nothing was allocated for it


@pytest.mark.parametrize("length", [0, 1, HEADER_SIZE - 1])
def test_undersized_length_rejected(length):
    with pytest.raises(ProtocolError, match="outside"):
        FrameReader().feed(LENGTH.pack(length))


def test_custom_max_frame():
    reader = FrameReader(max_frame=1000)
    assert reader.feed(frame(b"x" * 1000)) == [b"x" * 1000]
    with pytest.raises(ProtocolError):
        reader.feed(LENGTH.pack(1001))


def test_oversized_after_valid_frames():
    reader = FrameReader()
    with pytest.raises(ProtocolError):
        reader.feed(frame(b"a" * 20) + LENGTH.pack(2**31))


def test_big_buffer_reused_across_frames():
    reader = FrameReader()
    p1, p2 = payload_of(100_000, 1), payload_of(90_000, 2)
    (f1,) = reader.feed(frame(p1))
    buf_id = id(reader._big_buf)
    (f2,) = reader.feed(frame(p2))
    assert (f1, f2) == (p1, p2)
    assert id(reader._big_buf) == buf_id  # no reallocation for a smaller large frame


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=20))
def test_fuzz_frame_reader_raises_only_protocol_error(chunks):
    reader = FrameReader()
    try:
        for chunk in chunks:
            for f in reader.feed(chunk):
                assert HEADER_SIZE <= len(f) <= MAX_FRAME
    except ProtocolError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=4, max_size=4), st.binary(max_size=3000))
def test_fuzz_with_plausible_length(prefix, rest):
    # random lengths are mostly huge; force some in range so the reassembly paths get fuzzed too
    length = int.from_bytes(prefix, "big") % (MAX_FRAME + 100)
    reader = FrameReader(small_size=1024)
    try:
        frames = reader.feed(LENGTH.pack(length) + rest)
    except ProtocolError:
        assert not HEADER_SIZE <= length <= MAX_FRAME
        return
    if len(rest) >= length:
        assert frames[0] == rest[:length]
    else:
        assert frames == [] and reader.partial


def test_max_body_frame_exactly():
    body = os.urandom(MAX_FRAME_BODY)
    payload = pack_header(Kind.STREAM_DATA, 1) + body + b"T" * 16
    assert len(payload) == MAX_FRAME
    assert FrameReader().feed(frame(payload)) == [payload]
