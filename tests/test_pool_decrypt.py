"""Big incoming frames decrypted on the host's thread pool (``dht.sealer.OrderedReceiver``), as on
many-core machines. Off by default on this 2-core box: ``Limits(seal_threads=2)`` turns it on.

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

from dht import PeerUnreachable, sealer
from dht.limits import Limits
from dht.noise import AUTH_FAILED

MiB = 1 << 20
POOL = Limits(seal_threads=2)

pytestmark = [pytest.mark.usefixtures("loop_errors"), pytest.mark.timeout(60)]


class _ManualPool(concurrent.futures.Executor):
    """Runs nothing until told: the test completes jobs in any order it likes."""

    def __init__(self):
        self.jobs: list[tuple[concurrent.futures.Future, object]] = []

    def submit(self, fn, *args, **kwargs):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.append((fut, fn))
        return fut

    def run(self, i: int) -> None:
        fut, fn = self.jobs[i]
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fn()
        except Exception as e:
            fut.set_exception(e)
        else:
            fut.set_result(None)


class _Receiver:
    def __init__(self):
        self.delivered: list[object] = []
        self.failed: list[Exception] = []
        self.pauses: list[bool] = []
        self.q = sealer.OrderedReceiver(asyncio.get_running_loop(), self.delivered.append, self.failed.append,
                                        self.pauses.append)


async def _settled() -> None:
    """Let the loop run what the pool's done-callbacks scheduled (call_soon_threadsafe)."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_frames_reach_the_connection_in_arrival_order_whatever_order_they_open_in():
    r, pool = _Receiver(), _ManualPool()
    opened: list[int] = []
    for i in range(3):
        r.q.open(pool, f"big{i}", lambda i=i: opened.append(i))
    r.q.push("small")  # opened inline, received after them: waits for them
    assert r.pauses == [True]  # MAX_OPENING frames wait: the socket is not read on
    pool.run(2)
    pool.run(1)
    await _settled()
    assert r.delivered == []  # frame 0 is still being opened
    pool.run(0)
    await _settled()
    assert r.delivered == ["big0", "big1", "big2", "small"] and opened == [2, 1, 0]
    assert r.pauses == [True, False] and not r.failed and not r.q


async def test_a_frame_failing_its_tag_fails_the_connection_and_nothing_after_it_arrives():
    r, pool = _Receiver(), _ManualPool()

    def forged():
        raise sealer_error
    sealer_error = ValueError("tag")
    r.q.open(pool, "good", lambda: None)
    r.q.open(pool, "forged", forged)
    r.q.open(pool, "after", lambda: None)
    for i in (2, 1, 0):
        pool.run(i)
    await _settled()
    assert r.delivered == ["good"] and r.failed == [sealer_error] and not r.q


async def test_clearing_cancels_what_has_not_started_and_a_late_job_delivers_nothing():
    r, pool = _Receiver(), _ManualPool()
    for i in range(2):
        r.q.open(pool, i, lambda: None)
    pool.jobs[0][0].set_running_or_notify_cancel()  # job 0 is running on a thread
    r.q.clear()  # the connection closed
    assert pool.jobs[1][0].cancelled() and not pool.jobs[0][0].cancelled()
    pool.jobs[0][0].set_result(None)  # job 0 finishes after the close
    await _settled()
    assert r.delivered == [] and r.failed == []


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
    ended = asyncio.Event()
    seen: list = []

    async def sink(stream):
        seen.append(stream)
        try:
            while await stream.read(10) is not None:
                pass
        finally:  # (a connection that closes cancels its handlers)
            ended.set()

    b.on_stream("sink", sink)
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
    started, ended = asyncio.Event(), asyncio.Event()
    inbound: list = []

    async def sink(stream):
        inbound.append(stream)
        started.set()
        try:
            while await stream.read(10) is not None:
                pass
        finally:  # (a connection that closes cancels its handlers)
            ended.set()

    b.on_stream("sink", sink)
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
