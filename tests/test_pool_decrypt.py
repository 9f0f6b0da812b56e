"""Big incoming frames decrypted on the host's thread pool (``dht.sealer.OrderedReceiver``, whose
own tests are in test_sealer.py), as on many-core machines, through real connections. Off by
default on this 2-core box: ``Limits(seal_threads=2)`` turns it on.

What must not change: the order in which frames reach the connection (the bytes a stream delivers,
among small frames and RPCs), a frame failing its tag closes the connection with the words it
always did and nothing after it is delivered, and a connection closed while frames are still
being decrypted leaves no job, task or thread behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import random
import threading

import pytest

from dht import PeerUnreachable
from dht.limits import Limits
from dht.noise import AUTH_FAILED

MiB = 1 << 20
POOL = Limits(seal_threads=2)

pytestmark = [pytest.mark.usefixtures("loop_errors"), pytest.mark.timeout(60)]


class _CountingPool(concurrent.futures.Executor):
    """The host's pool, counting the jobs it runs; ``gate`` (when set) holds every job until opened."""

    def __init__(self, inner: concurrent.futures.ThreadPoolExecutor, gate: threading.Event | None = None):
        self.inner, self.gate, self.jobs = inner, gate, 0
        self.submitted = asyncio.Event()  # (submit runs on the loop's thread)

    def submit(self, fn, *args, **kwargs):
        self.jobs += 1
        self.submitted.set()
        gate = self.gate

        def job():
            if gate is not None:
                assert gate.wait(10)
            fn()
        return self.inner.submit(job)

    def shutdown(self, wait=True, *, cancel_futures=False):
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def _drain(streams: list, ended: asyncio.Event, started: asyncio.Event | None = None):
    """A stream handler that reads to the end, keeps each stream in ``streams`` and sets ``ended``
    when it stops (a closing connection cancels its handlers)."""
    async def sink(stream):
        streams.append(stream)
        if started is not None:
            started.set()
        try:
            while await stream.read(10) is not None:
                pass
        finally:
            ended.set()
    return sink


def _pooled(host, gate: threading.Event | None = None) -> _CountingPool:
    host.sealer = _CountingPool(host.sealer, gate)
    return host.sealer


async def test_a_stream_of_frames_of_mixed_sizes_arrives_whole_and_in_order_among_rpcs(make_host):
    a, b = await make_host(Limits(seal_threads=0)), await make_host(POOL)
    pool = _pooled(b)
    rng = random.Random(5)
    sizes = [rng.choice([100, 30_000, 70_000, 300_000, MiB, 4 * MiB, 4 * MiB + 9]) for _ in range(40)]
    data = rng.randbytes(sum(sizes))
    digest: list[str] = []

    async def sink(stream):
        h = hashlib.sha256()
        while (chunk := await stream.read(10)) is not None:
            h.update(chunk)
        digest.append(h.hexdigest())
        stream.write_eof()

    b.on_stream("sink", sink)
    async with asyncio.timeout(40):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        stream = await conn.open_stream("sink")

        async def send():
            view, at = memoryview(data), 0
            for n in sizes:
                await stream.write(view[at : at + n], timeout=10)
                at += n
            stream.write_eof()
            assert await stream.read(10) is None

        async def rpcs(done: asyncio.Future) -> int:
            n = 0
            while not done.done():
                assert await conn.call("echo", [n], timeout=10) == [n]
                n += 1
            return n

        sending = asyncio.ensure_future(send())
        calls = await rpcs(sending)
        await sending
    assert digest == [hashlib.sha256(data).hexdigest()] and calls > 0 and not conn.is_closed
    assert pool.jobs >= sum(n >= 256 << 10 for n in sizes)  # the big frames were opened on the pool


@pytest.mark.parametrize("on_pool", [True, False], ids=["pool", "inline"])
async def test_a_forged_frame_closes_the_connection_as_it_always_did(make_host, on_pool):
    a = await make_host(Limits(seal_threads=0))  # sealed inline: _write_frame sees every frame
    b = await make_host(Limits(seal_threads=2, decrypt_on_pool=on_pool))
    pool = _pooled(b)
    seen, ended = [], asyncio.Event()
    b.on_stream("sink", _drain(seen, ended))
    async with asyncio.timeout(30):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        stream = await conn.open_stream("sink")
        write, big = conn._write_frame, []

        def forge(prefix, ciphertext):
            if len(ciphertext) > MiB:
                big.append(1)
                if len(big) == 6:  # the sixth big frame: one bit of its ciphertext flipped
                    ciphertext = bytearray(ciphertext)
                    ciphertext[1000] ^= 1
            write(prefix, ciphertext)

        conn._write_frame = forge
        for _ in range(10):
            try:
                await stream.write(bytes(MiB), timeout=10)
            except PeerUnreachable:
                break
        await ended.wait()
    (inbound,) = seen
    assert inbound._conn.close_reason == AUTH_FAILED
    assert inbound.bytes_received == 5 * MiB  # the five frames before it, nothing after
    assert (pool.jobs >= 6) == on_pool


async def test_closing_while_frames_are_being_opened_leaves_nothing_running(make_host):
    a, b = await make_host(Limits(seal_threads=0)), await make_host(POOL)
    gate = threading.Event()
    pool = _pooled(b, gate)
    inbound, started, ended = [], asyncio.Event(), asyncio.Event()
    b.on_stream("sink", _drain(inbound, ended, started))
    async with asyncio.timeout(30):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        stream = await conn.open_stream("sink")
        writer = asyncio.ensure_future(stream.write(bytes(6 * MiB), timeout=10))
        await started.wait()
        server_side = inbound[0]._conn
        while pool.jobs < 2:  # frames held in the pool by the gate
            pool.submitted.clear()
            await pool.submitted.wait()
        assert server_side._inq and inbound[0].bytes_received == 0
        server_side.close("test closes it")
        gate.set()  # the jobs that had started finish after the close; the others were cancelled
        await ended.wait()
        await asyncio.gather(writer, return_exceptions=True)  # (done or failed: either is fine)
        threads = pool.inner._threads
        await b.close()
        for t in list(threads):
            await asyncio.to_thread(t.join, 10)
    assert inbound[0].bytes_received == 0 and not server_side._inq
    assert b.sealer is None and not any(t.is_alive() for t in threads)
