"""Serving a trainer's state from its live tensors (checkpoint.live, optim.state_sync): no copy
while nobody downloads, one while a download straddles a change, and every download consistent."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import torch

from dht import Host, Identity
from p2ptrain.checkpoint import fetch_state
from p2ptrain.checkpoint import live
from p2ptrain.checkpoint.live import LiveSource, StateLock, StateMoved
from p2ptrain.optim.state_sync import StateSync

pytestmark = pytest.mark.timeout(60)

N = 3 * (1 << 20) + 123  # floats: four 4 MiB chunks


class Trainer:
    """A state that changes under a StateLock, served by a StateSync on its own host."""

    def __init__(self) -> None:
        self.lock = StateLock()
        self.epoch, self.version = 3, 0
        self.w = torch.arange(N, dtype=torch.float32)
        self.step = torch.tensor(7.0)

    def state(self):
        return self.epoch, {"w": self.w, "opt": {"step": self.step}}

    def change(self) -> None:
        with self.lock:
            self.w.add_(1.0)
            self.step.add_(1.0)
            self.version += 1


@pytest.fixture
async def hosts():
    made: list[Host] = []

    async def make() -> Host:
        h = Host(Identity(), ("127.0.0.1", 0))
        await h.start()
        made.append(h)
        return h

    yield make
    for h in made:
        await h.close()


async def serving(hosts, trainer: Trainer) -> tuple[StateSync, tuple]:
    host = await hosts()
    sync = StateSync(host, "run/state", trainer.state, trainer.lock, version=lambda: trainer.version)
    await sync.start()
    return sync, (host.peer_id, ("127.0.0.1", host.listen_port))


async def test_a_download_that_straddles_a_change_gets_the_version_it_started_with(hosts, monkeypatch):
    trainer = Trainer()
    sync, provider = await serving(hosts, trainer)
    first_sent, go_on = asyncio.Event(), asyncio.Event()
    sent = 0

    async def gate(key: str, index: int) -> None:
        nonlocal sent
        sent += 1
        if sent == 2:
            first_sent.set()
            await go_on.wait()

    sync.server._before_chunk = gate  # type: ignore[method-assign]
    monkeypatch.setattr(live, "LEASE", 0.0)  # only a running stream keeps a version
    try:
        async with asyncio.timeout(30):
            me = await hosts()
            task = asyncio.create_task(fetch_state(me, "run/state", [provider], timeout=20, parallel=1))
            await first_sent.wait()
            assert sync.held_bytes == 0  # served live so far
            await asyncio.to_thread(trainer.change)  # the trainer steps mid-download: version preserved
            assert sync.held_bytes >= 4 * N
            go_on.set()
            result = await task
            state = result.restore()
            assert torch.equal(state["w"], torch.arange(N, dtype=torch.float32))
            assert float(state["opt"]["step"]) == 7.0 and result.manifest.meta["epoch"] == 3
            await asyncio.to_thread(trainer.change)  # the next change lets the copy go
            assert sync.held_bytes == 0
            result = await fetch_state(me, "run/state", [provider], timeout=20)  # a new manifest: the new state
            assert torch.equal(result.restore()["w"], torch.arange(N, dtype=torch.float32) + 2)
    finally:
        go_on.set()
        await sync.close()


async def test_nothing_is_copied_when_nobody_downloads_and_a_stale_version_is_refused(hosts, monkeypatch):
    trainer = Trainer()
    sync, provider = await serving(hosts, trainer)
    monkeypatch.setattr(live, "LEASE", 0.0)
    try:
        async with asyncio.timeout(30):
            me = await hosts()
            first = await fetch_state(me, "run/state", [provider], timeout=20)
            (src,) = sync._live
            for _ in range(3):
                await asyncio.to_thread(trainer.change)
            assert sync.held_bytes == 0
            with pytest.raises(StateMoved):
                src.read(0, 16)
            assert not src.acquire()
            again = await fetch_state(me, "run/state", [provider], timeout=20)
            assert again.manifest.id != first.manifest.id
            assert torch.equal(again.restore()["w"], torch.arange(N, dtype=torch.float32) + 3)
    finally:
        await sync.close()


def test_a_live_source_describes_the_bytes_a_snapshot_would_hold():
    """Peers of one epoch must publish identical manifests, whether they serve live or a copy."""
    from p2ptrain.checkpoint.manifest import build_snapshot

    trainer = Trainer()
    snap, _ = build_snapshot(trainer.state()[1])
    src = LiveSource(trainer.lock.raw, lambda: trainer.state()[1], lambda: trainer.version)
    assert src.describe({}).id == snap.id


def test_the_state_lock_runs_its_hook_inside_and_releases_when_the_hook_fails():
    lock, seen = StateLock(), []
    lock.before_change = lambda: seen.append(lock.locked())
    with lock:
        pass
    assert seen == [True] and not lock.locked()

    def fail() -> None:
        raise MemoryError("no room for the copy")

    lock.before_change = fail
    with pytest.raises(MemoryError):
        with lock:
            pass
    assert not lock.locked()


async def test_a_download_from_two_providers_that_keep_stepping_gets_one_verified_version(hosts):
    """The trainers step between every chunk sent, streams of one chunk each (gaps between them):
    the joiner still gets the version of its manifest, from both, and each provider copies it once."""
    trainers = [Trainer(), Trainer()]
    served = [await serving(hosts, t) for t in trainers]
    loop = asyncio.get_running_loop()
    steps, waiting, stop, started = [0], [], threading.Event(), threading.Event()

    def wake() -> None:
        while waiting:
            f = waiting.pop()
            if not f.done():
                f.set_result(None)

    def step_on() -> None:
        started.wait(20)
        while not stop.is_set():
            for t in trainers:
                t.change()
            steps[0] += 1
            loop.call_soon_threadsafe(wake)

    async def gate(key: str, index: int) -> None:  # a chunk goes out only after a step since the last one
        started.set()
        waiting.append(loop.create_future())
        await waiting[-1]

    for sync, _ in served:
        sync.server._before_chunk = gate  # type: ignore[method-assign]
    stepper = threading.Thread(target=step_on, daemon=True)
    stepper.start()
    try:
        async with asyncio.timeout(40):
            me = await hosts()
            result = await fetch_state(me, "run/state", [p for _, p in served], timeout=30,
                                       segment_bytes=1 << 20)
    finally:
        stop.set(), started.set()
        await asyncio.to_thread(stepper.join, 10)
    try:
        assert len(result.contributors) == 2 and steps[0] >= result.manifest.num_chunks
        state = result.restore()
        assert torch.equal(state["w"], torch.arange(N, dtype=torch.float32)) and float(state["opt"]["step"]) == 7.0
        for (sync, _), t in zip(served, trainers):
            assert float(t.step) == 7.0 + steps[0]  # they moved on meanwhile
            assert sync.held_bytes <= result.manifest.total_size  # one copy of the version served, at most
    finally:
        for sync, _ in served:
            await sync.close()


def test_each_chunk_read_renews_the_lease_so_a_slow_reader_keeps_its_version(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(live, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    trainer = Trainer()
    src = LiveSource(trainer.lock.raw, lambda: trainer.state()[1], lambda: trainer.version, chunk_size=1 << 20)
    trainer.lock.before_change = lambda: (src.preserve(), src.expire())  # (as StateSync's hook)
    src.lease()  # a peer got the manifest
    src.describe({})
    for i in range(4):  # each read follows the previous one within the lease, none within the first
        clock[0] += 0.9 * live.LEASE
        trainer.change()  # between two requests: no stream reads it now
        assert src.manifest.verify_chunk(i, memoryview(src.read(i << 20, (i + 1) << 20).numpy()))
    clock[0] += live.LEASE  # the reader is gone: the copy goes at the next change
    trainer.change()
    assert src.held_bytes == 0 and not src.readable
