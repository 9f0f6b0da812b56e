"""Snapshot buffers kept and touched ahead (p2ptrain.checkpoint.recycle), and the server giving a
snapshot's buffer back only once nothing reads it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from p2ptrain.checkpoint import StateServer, build_snapshot, fetch_state
from p2ptrain.checkpoint.recycle import Recycler, available_memory
from p2ptrain.checkpoint.sources import MemorySource
from test_state_transfer import KEY, check, make_state, snapshot, swarm  # noqa: F401 - swarm is a fixture


def test_take_reuses_a_given_buffer_that_fits_and_keeps_a_bounded_number():
    r = Recycler(keep=1)
    a = r.take(1000)
    assert a.numel() == 1000 and a.dtype == torch.uint8 and r.fresh == 1
    r.give(a)
    b = r.take(900)  # fits (900 <= 1000 <= 1800): a view of the same memory
    assert b.numel() == 900 and b.data_ptr() == a.data_ptr() and r.reused == 1
    r.give(b)
    tiny = r.take(100)  # would pin a buffer 10x its size: a fresh one instead
    assert tiny.data_ptr() != a.data_ptr() and r.fresh == 2
    r.give(tiny)  # keep=1: the larger spare stays
    assert r.take(1000).data_ptr() == a.data_ptr()
    assert not r.holds(1000)


def test_warm_touches_a_spare_in_the_background_and_take_uses_it():
    r = Recycler()
    assert r.warm(1 << 20)
    assert not r.warm(1 << 20)  # one is being made (or held) already
    r.wait()  # as a snapshot does (outside its lock) rather than faulting a second buffer
    buf = r.take(1 << 20)
    assert r.reused == 1 and r.fresh == 0 and int(buf.sum()) == 0
    r.close()
    r.give(buf)  # closed: nothing is kept any more
    assert not r.holds(1 << 20)


@pytest.mark.skipif(available_memory() is None, reason="needs /proc/meminfo")
def test_warm_declines_when_the_buffer_would_take_too_much_of_the_free_memory():
    r = Recycler(max_fraction=1e-12)
    assert not r.warm(1 << 20) and not r.holds(1 << 20)


def test_a_snapshot_in_a_reused_dirty_buffer_is_byte_identical_to_a_fresh_one():
    state = make_state(3)
    fresh_m, fresh_buf = build_snapshot(state, {"epoch": 1})
    r = Recycler()
    dirty = torch.full((fresh_buf.numel() + 100,), 0xAB, dtype=torch.uint8)
    r.give(dirty)
    m, buf = build_snapshot(state, {"epoch": 1}, alloc=r.take)
    assert r.reused == 1 and buf.data_ptr() == dirty.data_ptr()
    assert m.id == fresh_m.id and torch.equal(buf, fresh_buf)  # alignment padding zeroed, no stale bytes


def test_memory_source_releases_once_evicted_and_unread():
    released = []
    m, buf = snapshot()
    src = MemorySource(m, buf, released.append)
    assert src.acquire()
    src.evict()
    assert released == []  # a stream still reads it
    src.release()
    assert len(released) == 1 and released[0] is buf
    assert not src.acquire()  # too late: the memory belongs to its owner again


class Paused(StateServer):
    """Sends chunks until ``at``, then signals ``reached`` and waits for ``go``."""

    def __init__(self, host, at: int):
        super().__init__(host)
        self.at, self.reached, self.go = at, asyncio.Event(), asyncio.Event()

    async def _before_chunk(self, key: str, index: int) -> None:
        if index == self.at and not self.go.is_set():
            self.reached.set()
            await self.go.wait()


async def test_a_snapshot_being_downloaded_is_released_after_the_download_not_at_eviction(swarm):  # noqa: F811
    async with asyncio.timeout(15):
        released: list[torch.Tensor] = []
        a = snapshot(0, epoch=1)
        entry, server, _ = await swarm.provider(cls=Paused, at=3)
        server.publish(KEY, *a, on_release=released.append)
        other = (await swarm.provider(a))[0]
        me = await swarm.host()
        fetch = asyncio.ensure_future(fetch_state(me, KEY, [entry, other], timeout=15))
        await server.reached.wait()  # mid-stream: chunks 0-2 of a segment sent, the rest to come
        server.publish(KEY, *snapshot(1, epoch=2), on_release=released.append)
        server.publish(KEY, *snapshot(2, epoch=3), on_release=released.append)  # keep=2: a is evicted
        assert released == []  # the stream still sends from it
        server.go.set()
        res = await fetch
        check(res, a)  # the paused stream's bytes were left alone until it ended
        assert res.corrupt == set() and res.contributors[entry[0]] >= 3
        assert len(released) == 1 and released[0] is a[1]


async def test_drop_idle_gives_back_the_previous_snapshot_unless_a_stream_reads_it(swarm):  # noqa: F811
    async with asyncio.timeout(15):
        released: list[torch.Tensor] = []
        a, b, c = snapshot(0, epoch=1), snapshot(1, epoch=2), snapshot(2, epoch=3)
        entry, server, _ = await swarm.provider(cls=Paused, at=1)
        server.publish(KEY, *a, on_release=released.append)
        server.publish(KEY, *b, on_release=released.append)
        server.drop_idle(KEY)
        assert [x is a[1] for x in released] == [True]  # a was idle: back to its owner at once
        assert [s.manifest.id for s in await server._held(KEY)] == [b[0].id]
        me = await swarm.host()
        fetch = asyncio.ensure_future(fetch_state(me, KEY, [entry], timeout=15, parallel=1))
        await server.reached.wait()  # a stream reads b
        server.publish(KEY, *c, on_release=released.append)
        server.drop_idle(KEY)
        assert len(released) == 1  # b is being read: it stays, and so does its buffer
        assert [s.manifest.id for s in await server._held(KEY)] == [c[0].id, b[0].id]
        server.go.set()
        check(await fetch, b)


def test_warm_can_touch_several_spares_and_trim_drops_the_extra():
    r = Recycler(keep=1)
    assert r.warm(1 << 16, count=2)
    r.wait()
    assert r.holds(1 << 16, count=2) and not r.warm(1 << 16, count=2)
    r.trim(1)
    assert r.holds(1 << 16) and not r.holds(1 << 16, count=2)
