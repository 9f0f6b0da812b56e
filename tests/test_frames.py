"""Big stream frames: the handshake-negotiated frame size, the control-frame limit, and the buffer
pool that encrypted/decrypted frames reuse (never while anything still references a buffer)."""

from __future__ import annotations

import asyncio
import os

import pytest

from dht.bufpool import BufferPool
from dht.identity import Identity
from dht.noise import XXHandshake
from dht.transport import Host
from dht.wire import LEGACY_FRAME_BODY, MAX_FRAME_BODY, MAX_MESSAGE, Kind, pack

MiB = 1 << 20


def test_pool_reuses_only_unreferenced_buffers():
    pool = BufferPool(1024, keep=2)
    a = pool.get()
    view = memoryview(a)[:10]  # someone still looks at it: not reusable
    b = pool.get()
    assert b is not a
    del a
    assert pool.get() is not view.obj  # the view keeps the buffer alive and out of reuse
    c = pool.get()
    assert c is b or c is not view.obj
    view.release()
    del b, c
    got = {id(pool.get()), id(pool.get())}
    assert len(got) == 1  # both idle now: the first idle one comes back
    extra = [pool.get() for _ in range(4)]  # all referenced: fresh buffers, only `keep` retained
    assert len(pool._bufs) == 2 and len({id(x) for x in extra}) == 4


def test_pool_sizes_buffers_to_the_frames_and_follows_a_change_of_size():
    pool = BufferPool(4 * MiB, keep=2, granule=64 << 10)
    small = pool.get(MiB + 20)
    assert len(small) == MiB + (64 << 10)  # rounded up to the granule, not a whole 4 MiB frame
    assert len(pool.get()) == 4 * MiB  # (no size: the largest) and two kept now
    del small
    assert len(pool.get(MiB)) == MiB + (64 << 10)  # the idle small one fits (at most twice the size)
    assert len(pool.get(3 * MiB)) == 4 * MiB  # the idle 4 MiB one fits too: nothing new
    assert len(pool._bufs) == 2
    big_again = pool.get(4 * MiB)
    assert len(big_again) == 4 * MiB and any(b is big_again for b in pool._bufs)
    half = pool.get(256 << 10)  # full pool: this size replaces the idle buffer of another size
    assert len(half) == 256 << 10 and any(b is half for b in pool._bufs)
    assert sorted(len(b) for b in pool._bufs) == [256 << 10, 4 * MiB]


def test_pool_gives_frames_of_nearly_the_largest_size_one_size():
    """A whole received frame, a full frame's plaintext and its ciphertext differ by a few bytes:
    all get the largest size, so an idle buffer of one serves the others (as three sizes they
    missed each other and a fresh multi-MiB buffer page-faulted in)."""
    size = 4 * MiB + 24
    pool = BufferPool(size, keep=2, granule=64 << 10)
    plain = pool.get(4 * MiB)
    assert len(plain) >= size
    first = id(plain)
    del plain  # idle now
    sealed = pool.get(4 * MiB + 16)
    assert id(sealed) == first  # a ciphertext takes the plaintext's idle buffer
    del sealed
    whole = pool.get(size)
    assert id(whole) == first  # and so does a whole received frame
    other = pool.get(4 * MiB)  # `whole` is held: a second buffer, of the same size
    assert other is not whole and len(other) == len(whole)
    assert len(pool.get(2 * MiB)) == 2 * MiB  # half the largest or less: sized to the request


def test_pool_buffers_are_at_most_twice_what_is_asked():
    """A received frame stays in its pooled buffer only while that holds (Connection copies it out
    otherwise, for the bound Limits states). A 2 MiB frame (+ header and tag) rounded up to the
    granule came to just over half the largest size and got a 4 MiB + 64 KiB buffer: every such
    frame of an all-reduce was copied, a fresh allocation and ~500 page faults each."""
    size = 4 * MiB + 24
    pool = BufferPool(size, keep=8, granule=64 << 10)
    for n in (64 << 10, 300_000, 2 * MiB - 24, 2 * MiB, 2 * MiB + 24, 2 * MiB + (64 << 10) + 1, 3 * MiB, size):
        assert n <= len(pool.get(n)) <= 2 * n, n
    frame = pool.get(2 * MiB + 24)
    del frame
    assert len(pool.get(2 * MiB + 24)) <= 2 * (2 * MiB + 24)  # reused, and still within twice


def test_pool_keeps_at_most_max_bytes_of_buffers():
    """Beside the count, a byte budget: many small buffers or a few big ones, not many big ones."""
    pool = BufferPool(4 * MiB, keep=100, granule=64 << 10, max_bytes=9 * MiB)
    big = [pool.get() for _ in range(3)]  # all held: three allocations, two fit the budget
    assert len(pool._bufs) == 2 and all(len(b) == 4 * MiB for b in big)
    small = [pool.get(MiB) for _ in range(3)]  # no idle buffer: 1 MiB more fits, the rest does not
    assert len(pool._bufs) == 3 and sum(map(len, pool._bufs)) == 9 * MiB
    del big, small  # all idle: a small request may now replace an idle big one
    pool = BufferPool(4 * MiB, keep=100, granule=64 << 10, max_bytes=8 * MiB)
    held = [pool.get(), pool.get()]
    del held
    kept = [pool.get(MiB) for _ in range(8)]  # the first two replace the idle 4 MiB ones
    assert [len(b) for b in pool._bufs] == [MiB] * 8 and all(any(b is k for k in kept) for b in pool._bufs)
    assert len(pool.get(MiB)) == MiB and len(pool._bufs) == 8  # a ninth does not fit the budget


async def _pair(frame_a: int | None = None):
    a, b = Host(Identity()), Host(Identity())
    await a.start()
    await b.start()
    received: list[int] = []

    async def sink(stream):
        while (chunk := await stream.read(timeout=5)) is not None:
            received.append(len(chunk))

    b.on_stream("sink", sink)
    return a, b, received


async def test_big_writes_arrive_as_big_frames_and_data_is_intact():
    a, b, received = await _pair()
    try:
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        assert conn.max_data_body == MAX_FRAME_BODY
        data = os.urandom(3 * MAX_FRAME_BODY + 5)
        got = bytearray()

        async def collect(stream):
            while (chunk := await stream.read(timeout=5)) is not None:
                got.extend(chunk)  # views of pooled buffers: copied out before the next read
                received.append(len(chunk))

        b.on_stream("collect", collect)
        s = await conn.open_stream("collect")
        await s.write(data, timeout=5)
        s.write_eof()
        for _ in range(200):
            if len(got) == len(data):
                break
            await asyncio.sleep(0.01)
        assert bytes(got) == data
        assert received[:3] == [MAX_FRAME_BODY] * 3
    finally:
        await a.close()
        await b.close()


async def test_peer_without_frame_field_gets_legacy_frames(monkeypatch):
    a, b, received = await _pair()
    try:
        # b speaks the old protocol: it announces no frame size, so a must send 1 MiB frames
        orig = XXHandshake.__init__

        def old_init(self, *args, local_payload=None, **kw):
            payload = {k: v for k, v in (local_payload or {}).items() if k != "frame"}
            orig(self, *args, local_payload=payload, **kw)

        monkeypatch.setattr(XXHandshake, "__init__", old_init)
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        assert conn.max_data_body == LEGACY_FRAME_BODY
        s = await conn.open_stream("sink")
        await s.write(os.urandom(2 * MiB + 1), timeout=5)
        s.write_eof()
        for _ in range(200):
            if sum(received) == 2 * MiB + 1:
                break
            await asyncio.sleep(0.01)
        assert received == [MiB, MiB, 1]
    finally:
        await a.close()
        await b.close()


async def test_oversized_control_frame_closes_connection():
    a, b, _received = await _pair()
    try:
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        # a REQUEST body beyond the 1 MiB message limit (but within the 4 MiB frame limit)
        conn.send_frame(Kind.REQUEST, 1, pack(["echo", b"x" * (MAX_MESSAGE + 10)]))
        for _ in range(200):
            if conn.is_closed:
                break
            await asyncio.sleep(0.01)
        assert conn.is_closed
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("size", [LEGACY_FRAME_BODY, MAX_FRAME_BODY])
def test_limits_are_ordered(size):
    assert MAX_MESSAGE <= size <= MAX_FRAME_BODY
