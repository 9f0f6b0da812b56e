"""Big frames encrypted (and decrypted) on a thread pool (``dht.sealer``), as on many-core machines.

The pool is off by default on this 2-core box, so these tests turn it on with
``Limits(seal_threads=2)`` and check what must not change: the bytes a stream delivers, frame
order against small control frames and RPCs on the same connection, a writer cancelled mid-frame,
and an all-reduce round's exact result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os

import pytest
import torch

from dht import sealer
from dht.identity import Identity
from dht.limits import Limits
from dht.stream import DEFAULT_STREAM_WINDOW, WIDE_STREAM_WINDOW
from dht.transport import Host
from p2ptrain.averaging.allreduce import AllReduceService
from p2ptrain.averaging.round_types import AllReduceConfig
from p2ptrain.averaging.group import Group, Member

MiB = 1 << 20
SEAL = Limits(seal_threads=2)

pytestmark = [pytest.mark.usefixtures("loop_errors"), pytest.mark.timeout(60)]


def pattern(nbytes: int, seed: int) -> bytes:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


async def test_pool_and_wide_windows_only_where_asked_or_many_cores(make_host, monkeypatch):
    assert (await make_host(SEAL)).sealer is not None
    assert (await make_host(Limits(seal_threads=0))).sealer is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(2)))
    assert sealer.default_threads() == 0
    two = await make_host(Limits())
    assert two.sealer is None and two.stream_window == DEFAULT_STREAM_WINDOW
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert sealer.default_threads() == 2
    many = await make_host(Limits())
    assert many.sealer is not None and many.stream_window == WIDE_STREAM_WINDOW
    assert many.inbound_stream_cap == 128 * WIDE_STREAM_WINDOW and two.inbound_stream_cap == 1 << 30
    assert (await make_host(Limits(stream_window=1 << 20))).stream_window == 1 << 20
    inline = await make_host(Limits(seal_threads=0))  # no sealing threads: no reason for wide windows
    assert inline.sealer is None and inline.stream_window == DEFAULT_STREAM_WINDOW
    # what a host advertises is what its peer's streams to it may have in flight
    conn = await two.connect("127.0.0.1", many.listen_port, many.peer_id)
    assert conn.remote_window == WIDE_STREAM_WINDOW


async def test_streams_and_rpcs_share_a_sealing_connection(make_host):
    """Two streams of 4 MiB frames both ways plus a stream of RPCs on the same connection: every
    byte arrives, in order, and every RPC answers (a nonce out of order would fail the frame's
    authentication and close the connection)."""
    a, b = await make_host(SEAL), await make_host(SEAL)
    sizes = {"x": 24 * MiB + 12345, "y": 17 * MiB + 7}
    got: dict[str, str] = {}
    done = asyncio.Event()

    async def sink(stream):
        h = hashlib.sha256()
        while (chunk := await stream.read(10)) is not None:
            h.update(chunk)
        got[stream.header["name"]] = h.hexdigest()
        await stream.write(b"ok")
        stream.write_eof()
        if len(got) == len(sizes):
            done.set()

    b.on_stream("sink", sink)
    async with asyncio.timeout(30):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)

        async def send(name: str, seed: int) -> bytes:
            data = pattern(sizes[name], seed)
            stream = await conn.open_stream("sink", {"name": name})
            view = memoryview(data)
            for i in range(0, len(view), 4 * MiB):
                await stream.write(view[i : i + 4 * MiB], timeout=10)
            stream.write_eof()
            assert await stream.read_all(16, timeout=10) == b"ok"
            return data

        async def rpcs() -> int:
            n = 0
            while not done.is_set():
                assert await conn.call("echo", [n, b"z" * 300], timeout=10) == [n, b"z" * 300]
                n += 1
                await asyncio.sleep(0)
            return n

        sent_x, sent_y, n_calls = await asyncio.gather(send("x", 1), send("y", 2), rpcs())
        await done.wait()
    assert got == {"x": hashlib.sha256(sent_x).hexdigest(), "y": hashlib.sha256(sent_y).hexdigest()}
    assert n_calls > 0 and not conn.is_closed


async def test_a_writer_cancelled_mid_frame_leaves_the_connection_usable(make_host):
    a, b = await make_host(SEAL), await make_host(SEAL)
    received = []

    async def slow_sink(stream):
        while (chunk := await stream.read(10)) is not None:
            received.append(len(chunk))

    b.on_stream("sink", slow_sink)
    async with asyncio.timeout(30):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        stream = await conn.open_stream("sink")
        buf = bytearray(pattern(32 * MiB, 3))

        async def write_all():
            await stream.write(buf, timeout=10)

        for _ in range(4):  # cancel at a few points of the transfer
            task = asyncio.create_task(write_all())
            await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            buf[:] = bytes(len(buf))  # the caller reuses its buffer at once: nothing may read it now
            if stream.closed:
                break
        stream.reset("cancelled")
        # the connection (its nonces) survived: calls and a fresh stream still work
        assert await conn.call("echo", "still here", timeout=10) == "still here"
        data = pattern(9 * MiB, 4)
        got = []

        async def check(stream):
            got.append(bytes(await stream.read_all(16 * MiB, timeout=10)))

        b.on_stream("check", check)
        s2 = await conn.open_stream("check")
        await s2.write(data, timeout=10)
        s2.write_eof()
        while not got:
            await asyncio.sleep(0.01)
    assert got[0] == data and not conn.is_closed


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


class _OpensAtTheSecondFrame(_ManualPool):
    """Decrypts nothing until a second big frame arrives, then everything: whatever came between
    the first and the second waits behind the first, as behind a decryption still running."""

    def __init__(self):
        super().__init__()
        self.ran = 0

    def submit(self, fn, *args, **kwargs):
        fut = super().submit(fn)
        while len(self.jobs) >= 2 and self.ran < len(self.jobs):
            self.run(self.ran)
            self.ran += 1
        return fut


async def test_a_stream_opened_behind_a_frame_being_opened_keeps_its_first_frame(make_host):
    """The peer opens a stream while a big frame of another is still being decrypted: the open
    waits behind it, and the new stream's first data frame, right behind the open, is the new
    stream's data (not data of a stream unknown here, dropped unread)."""
    a, b = await make_host(Limits(seal_threads=0)), await make_host(SEAL)
    b.sealer.shutdown()
    b.sealer = _OpensAtTheSecondFrame()
    got: dict[int, bytes] = {}
    both = asyncio.Event()

    async def sink(stream):
        got[stream.header] = bytes(await stream.read_all(4 * MiB, timeout=10))
        if len(got) == 2:
            both.set()

    b.on_stream("sink", sink)
    first, second = pattern(2 * MiB, 5), pattern(MiB, 6)
    async with asyncio.timeout(20):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        s0 = await conn.open_stream("sink", 0)
        await s0.write(first[:MiB], timeout=10)  # held: its decryption has not started
        s1 = await conn.open_stream("sink", 1)
        await s1.write(second, timeout=10)  # the open and the data wait behind it
        await s0.write(first[MiB:], timeout=10)  # the second big frame: all are opened now
        s0.write_eof()
        s1.write_eof()
        await both.wait()
    assert got == {0: first, 1: second}
    assert len(b.sealer.jobs) == 3  # every big frame was decrypted on the pool, none dropped


def _sender(fail=pytest.fail) -> tuple[sealer.OrderedSender, list[bytes]]:
    """A send queue whose frames are recorded (their prefixes) instead of written to a socket."""
    written: list[bytes] = []
    return sealer.OrderedSender(asyncio.get_running_loop(), lambda prefix, ct: written.append(prefix), fail), written


async def test_frames_leave_in_queue_order_whatever_order_they_are_sealed_in():
    failed: list[str] = []
    q, written = _sender(failed.append)
    pool = _ManualPool()
    ran: list[int] = []
    seals = [asyncio.create_task(q.seal(pool, b"big%d" % i, b"", lambda i=i: ran.append(i))) for i in range(3)]
    await asyncio.sleep(0)
    q.push_ready(b"small", b"")  # a control frame posted behind them waits for them
    assert written == [] and len(q) == 4
    pool.run(2)
    pool.run(1)
    await asyncio.sleep(0.01)
    assert written == []  # frame 0 is still being sealed
    pool.run(0)
    await asyncio.wait_for(asyncio.gather(*seals), 5)
    assert written == [b"big0", b"big1", b"big2", b"small"] and ran == [2, 1, 0] and not failed and not q


async def test_a_cancelled_seal_not_started_is_sealed_inline_and_sent_in_turn():
    q, written = _sender()
    pool = _ManualPool()
    ran: list[str] = []
    t0 = asyncio.create_task(q.seal(pool, b"a", b"", lambda: ran.append("a")))
    t1 = asyncio.create_task(q.seal(pool, b"b", b"", lambda: ran.append("b")))
    await asyncio.sleep(0)
    t1.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t1
    assert ran == ["b"] and written == []  # sealed before its caller got its buffer back; waits for "a"
    pool.run(0)
    await asyncio.wait_for(t0, 5)
    assert written == [b"a", b"b"]


async def test_a_failed_seal_closes_the_connection_instead_of_skipping_a_nonce():
    failed: list[str] = []
    q, written = _sender(failed.append)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        def boom():
            raise ValueError("bad buffer")
        await asyncio.wait_for(q.seal(pool, b"x", b"", boom), 5)
        q.push_ready(b"after", b"")
    finally:
        pool.shutdown()
    assert written == [] and len(failed) == 1 and "bad buffer" in failed[0]


async def test_allreduce_exact_with_sealing_threads():
    n, numel = 3, (3 << 20) + 77  # chunks of 1M values: 4 MiB frames, sealed on the pool
    made, services, members = [], [], []
    try:
        for _ in range(n):
            h = Host(Identity(), ("127.0.0.1", 0), limits=SEAL)
            await h.start()
            made.append(h)
            members.append(Member(h.peer_id, ("127.0.0.1", h.listen_port), 1.0))
            svc = AllReduceService(h, AllReduceConfig(timeout=30))
            await svc.start()
            services.append(svc)
        group = Group(os.urandom(16), tuple(members))
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
        flats = [x.clone() for x in inputs]
        weights = [1.0, 2.0, 3.0]
        async with asyncio.timeout(40):
            results = await asyncio.gather(*(s.run(group, r, flats[r], weights[r]) for r, s in enumerate(services)))
        want = sum(w * x for w, x in zip(weights, inputs)) / sum(weights)
        for r, res in enumerate(results):
            assert res.ok, res.failed
            torch.testing.assert_close(flats[r], want, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(flats[0], f) for f in flats[1:])
    finally:
        for s in services:
            await s.close()
        for h in made:
            await h.close()


async def test_a_pool_shutting_down_under_a_writer_seals_inline_without_cancelling_it():
    q, written = _sender()
    pool = _ManualPool()
    ran: list[str] = []
    t = asyncio.create_task(q.seal(pool, b"a", b"", lambda: ran.append("a")))
    await asyncio.sleep(0)
    pool.jobs[0][0].cancel()  # what shutdown(cancel_futures=True) does to a job not started
    await asyncio.wait_for(t, 5)  # returns: the writer's task was not the one cancelled
    assert ran == ["a"] and written == [b"a"] and not t.cancelled()


# ---------------------------------------------------------------- received frames (OrderedReceiver)

class _Receiver:
    """An OrderedReceiver whose deliveries, failures and pauses are recorded."""

    def __init__(self):
        self.delivered: list[object] = []
        self.failed: list[Exception] = []
        self.pauses: list[bool] = []
        self.q = sealer.OrderedReceiver(asyncio.get_running_loop(), self.delivered.append, self.failed.append,
                                        self.pauses.append)


async def test_frames_reach_the_connection_in_arrival_order_whatever_order_they_open_in():
    r, pool = _Receiver(), _ManualPool()
    opened: list[int] = []
    for i in range(3):
        r.q.open(pool, f"big{i}", lambda i=i: opened.append(i))
    r.q.push("small")  # opened inline, received after them: waits for them
    assert r.pauses == [True]  # MAX_OPENING frames wait: the socket is not read on
    pool.run(2)
    pool.run(1)
    r.q.flush()  # (what the pool's done-callback schedules)
    assert r.delivered == []  # frame 0 is still being opened
    pool.run(0)
    r.q.flush()
    assert r.delivered == ["big0", "big1", "big2", "small"] and opened == [2, 1, 0]
    assert r.pauses == [True, False] and not r.failed and not r.q


async def test_a_frame_failing_its_tag_fails_the_connection_and_nothing_after_it_arrives():
    r, pool = _Receiver(), _ManualPool()

    def forged():
        raise tag_error
    tag_error = ValueError("tag")
    r.q.open(pool, "good", lambda: None)
    r.q.open(pool, "forged", forged)
    r.q.open(pool, "after", lambda: None)
    for i in (2, 1, 0):
        pool.run(i)
    r.q.flush()
    assert r.delivered == ["good"] and r.failed == [tag_error] and not r.q


async def test_clearing_cancels_what_has_not_started_and_a_late_job_delivers_nothing():
    r, pool = _Receiver(), _ManualPool()
    for i in range(2):
        r.q.open(pool, i, lambda: None)
    pool.jobs[0][0].set_running_or_notify_cancel()  # job 0 is running on a thread
    r.q.clear()  # the connection closed
    assert pool.jobs[1][0].cancelled() and not pool.jobs[0][0].cancelled()
    pool.jobs[0][0].set_result(None)  # job 0 finishes after the close
    r.q.flush()
    assert r.delivered == [] and r.failed == []


async def test_a_frame_whose_job_the_closing_pool_cancelled_is_opened_inline_in_turn():
    r, pool = _Receiver(), _ManualPool()
    opened: list[str] = []
    r.q.open(pool, "a", lambda: opened.append("a"))
    pool.jobs[0][0].cancel()  # what shutdown(cancel_futures=True) does to a job not started
    r.q.flush()
    assert opened == ["a"] and r.delivered == ["a"] and not r.failed
