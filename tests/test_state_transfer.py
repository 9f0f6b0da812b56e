"""State transfer over real loopback Hosts in one event loop: parallel fetch from several
providers, corrupt / dying / stalling / hostile providers, manifest choice, timeouts, and the
sans-IO chunk schedule.

Every test is bounded by ``asyncio.timeout``; no sleeps are used to synchronise (hooks signal
events); the fixture closes every server and host.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from dht import Host, Identity, RPCError, StreamReset
from p2ptrain.checkpoint import (
    ChunksUnavailableError,
    NoProviderError,
    StateServer,
    StateTimeoutError,
    StateTransferError,
    StateTooLarge,
    build_snapshot,
    fetch_state,
)
from p2ptrain.checkpoint.schedule import ChunkSchedule
from p2ptrain.checkpoint.state_protocol import CHUNKS_PROTOCOL, INLINE_MANIFEST_MAX, MANIFEST_METHOD

CHUNK = 64 << 10
KEY = "run/state"


def make_state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(400_000, generator=g), "b": torch.randn(77, generator=g).to(torch.bfloat16)},
        "opt": {"state": {0: {"step": torch.tensor(float(seed)), "idx": torch.arange(50_000)}}, "param_groups": []},
    }


def snapshot(seed: int = 0, epoch: int = 1, **meta):
    return build_snapshot(make_state(seed), {"epoch": epoch, "seed": seed, **meta}, chunk_size=CHUNK)


class Blocking(StateServer):
    """Serves ``before`` chunks in all, then signals ``reached`` and hangs until cancelled."""

    def __init__(self, host: Host, before: int = 0):
        super().__init__(host)
        self.before, self.sent, self.reached = before, 0, asyncio.Event()

    async def _before_chunk(self, key: str, index: int) -> None:
        if self.sent >= self.before:
            self.reached.set()
            await asyncio.Event().wait()
        self.sent += 1


class Counting(StateServer):
    requests = 0

    async def _on_chunks(self, stream) -> None:
        self.requests += 1
        await super()._on_chunks(stream)


class Swarm:
    def __init__(self):
        self.hosts: list[Host] = []
        self.servers: list[StateServer] = []

    async def host(self) -> Host:
        h = Host(Identity(), ("127.0.0.1", 0))
        await h.start()
        self.hosts.append(h)
        return h

    async def provider(self, snap=None, cls=StateServer, **kw):
        """A host serving ``snap`` (manifest, buffer) under KEY; returns (entry, server, host)."""
        h = await self.host()
        server = cls(h, **kw)
        await server.start()
        self.servers.append(server)
        if snap is not None:
            server.publish(KEY, *snap)
        return (h.peer_id, ("127.0.0.1", h.listen_port)), server, h

    async def close(self):
        for s in self.servers:
            await s.close()
        for h in self.hosts:
            await h.close()


@pytest.fixture
async def swarm(loop_errors):
    s = Swarm()
    yield s
    await s.close()


def check(result, snap):
    m, buf = snap
    assert result.manifest.id == m.id
    assert torch.equal(result.buffer, buf)
    state, expected = result.restore(), make_state(m.meta["seed"])
    assert torch.equal(state["model"]["w"], expected["model"]["w"])
    assert torch.equal(state["model"]["b"], expected["model"]["b"])
    assert torch.equal(state["opt"]["state"][0]["step"], expected["opt"]["state"][0]["step"])
    assert torch.equal(state["opt"]["state"][0]["idx"], expected["opt"]["state"][0]["idx"])


# ---------------------------------------------------------------------------- happy paths


async def test_fetch_from_three_providers_in_parallel(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        provs = [(await swarm.provider(snap))[0] for _ in range(3)]
        me = await swarm.host()
        res = await fetch_state(me, KEY, provs, timeout=10)
        check(res, snap)
        assert set(res.contributors) == {p for p, _ in provs}
        assert sum(res.contributors.values()) == snap[0].num_chunks
        assert res.dropped == {} and res.corrupt == set()
        # parallel=1: one provider streams, the others wait in reserve
        res = await fetch_state(me, KEY, provs, parallel=1, timeout=10)
        check(res, snap)
        assert len(res.contributors) == 1


async def test_large_manifest_travels_over_a_stream(swarm):
    async with asyncio.timeout(10):
        snap = snapshot(blob=b"\x07" * (INLINE_MANIFEST_MAX + 1000))
        assert len(snap[0].to_bytes()) > INLINE_MANIFEST_MAX
        provs = [(await swarm.provider(snap))[0] for _ in range(2)]
        res = await fetch_state(await swarm.host(), KEY, provs, timeout=10)
        check(res, snap)
        assert res.manifest.meta["blob"] == snap[0].meta["blob"]


# ---------------------------------------------------------------------------- faulty providers


async def test_corrupt_provider_is_detected_refetched_and_reported(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        m, buf = snap
        bad_buf = buf.clone()
        bad_buf[::CHUNK] ^= 0xFF  # first byte of every chunk flipped
        good = [(await swarm.provider(snap))[0] for _ in range(2)]
        bad, bad_server, _ = await swarm.provider((m, bad_buf), cls=Counting)
        res = await fetch_state(await swarm.host(), KEY, [good[0], bad, good[1]], timeout=10)
        check(res, snap)
        assert res.corrupt == {bad[0]}
        assert bad[0] not in res.contributors and set(res.contributors) == {p for p, _ in good}
        assert "does not match its digest" in res.dropped[bad[0]]
        assert bad_server.requests == 1  # never asked again


async def test_placed_fetch_writes_verified_chunks_into_the_callers_tensors(swarm):
    """``place=``: the model tensor lands in the caller's own tensor, a corrupt provider's chunks
    are re-fetched from the others before they get there, and no whole-state buffer is kept."""
    from p2ptrain.checkpoint.placement import Placement

    async with asyncio.timeout(10):
        snap = snapshot()
        m, buf = snap
        bad_buf = buf.clone()
        bad_buf[::CHUNK] ^= 0xFF
        good = [(await swarm.provider(snap))[0] for _ in range(2)]
        bad, _, _ = await swarm.provider((m, bad_buf))
        mine = torch.zeros(400_000)
        ptr = mine.data_ptr()

        def place(manifest):
            (w,) = [i for i, e in enumerate(manifest.tensors) if e.nbytes == mine.numel() * 4]
            return Placement(manifest, {w: mine})

        res = await fetch_state(await swarm.host(), KEY, [good[0], bad, good[1]], timeout=10, place=place)
        assert res.buffer is None and res.corrupt == {bad[0]}
        state, expected = res.restore(), make_state(m.meta["seed"])
        assert state["model"]["w"] is mine and mine.data_ptr() == ptr
        assert torch.equal(mine, expected["model"]["w"])
        assert torch.equal(state["opt"]["state"][0]["idx"], expected["opt"]["state"][0]["idx"])
        assert torch.equal(res.restore(copy=True)["model"]["w"], expected["model"]["w"])
        with pytest.raises(ValueError, match="place= and on_chunk="):
            await fetch_state(await swarm.host(), KEY, good, place=place, on_chunk=lambda *a: None)


async def test_provider_killed_mid_transfer_others_finish(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        good = [(await swarm.provider(snap))[0] for _ in range(2)]
        dying, server, dying_host = await swarm.provider(snap, cls=Blocking, before=1)
        task = asyncio.create_task(fetch_state(await swarm.host(), KEY, [dying, *good], timeout=10))
        await server.reached.wait()  # it has sent one chunk and is in the middle of its segment
        await dying_host.close()
        res = await task
        check(res, snap)
        assert dying[0] in res.dropped and "failed mid-transfer" in res.dropped[dying[0]]
        assert res.contributors.get(dying[0], 0) <= 1 and res.corrupt == set()


async def test_stalled_provider_loses_its_chunks_to_the_others(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        good = (await swarm.provider(snap))[0]
        stalled, server, _ = await swarm.provider(snap, cls=Blocking)
        res = await fetch_state(await swarm.host(), KEY, [stalled, good], stall_timeout=0.2, timeout=10)
        check(res, snap)
        assert server.reached.is_set() and "no data within" in res.dropped[stalled[0]]
        assert list(res.contributors) == [good[0]]


async def test_hostile_providers_are_dropped(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        m, _ = snap
        good = (await swarm.provider(snap))[0]
        liars = []
        replies = [
            {"id": m.id, "size": 10, "manifest": b"0123456789", "held": []},  # bytes do not match the id
            "not a map",
            {"id": b"short", "size": 1, "manifest": None, "held": []},
        ]
        for reply in replies:
            h = await swarm.host()

            async def answer(_conn, _args, reply=reply):
                return reply
            h.on_request(MANIFEST_METHOD, answer)
            liars.append((h.peer_id, ("127.0.0.1", h.listen_port)))
        # one that announces the real manifest but streams more bytes than it was asked for
        h = await swarm.host()

        async def manifest(_conn, _args):
            return {"id": m.id, "size": len(m.to_bytes()), "manifest": m.to_bytes(), "held": [m.id]}

        async def flood(stream):
            await stream.write(b"\x00" * (stream.header["count"] * CHUNK + 10))
        h.on_request(MANIFEST_METHOD, manifest)
        h.on_stream(CHUNKS_PROTOCOL, flood)
        flooder = (h.peer_id, ("127.0.0.1", h.listen_port))
        res = await fetch_state(await swarm.host(), KEY, [*liars, flooder, good], timeout=10)
        check(res, snap)
        assert res.corrupt == {p for p, _ in liars} | {flooder[0]}
        assert all("malformed manifest reply" in res.dropped[p] for p, _ in liars)
        assert "sent more bytes" in res.dropped[flooder[0]] or "does not match" in res.dropped[flooder[0]]


async def test_all_providers_fail_raises_naming_missing_chunks(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        m, buf = snap
        bad_buf = buf.clone()
        bad_buf[-1] ^= 1  # only the last chunk is wrong, everywhere
        provs = [(await swarm.provider((m, bad_buf)))[0] for _ in range(2)]
        with pytest.raises(ChunksUnavailableError, match=rf"chunks {m.num_chunks - 1} of state 'run/state'"):
            await fetch_state(await swarm.host(), KEY, provs, timeout=10)


# ---------------------------------------------------------------------------- choosing the manifest


async def test_majority_manifest_wins(swarm):
    async with asyncio.timeout(10):
        a, b = snapshot(0, epoch=1), snapshot(1, epoch=9)
        pa = [(await swarm.provider(a))[0] for _ in range(2)]
        pb = (await swarm.provider(b))[0]
        res = await fetch_state(await swarm.host(), KEY, [pb, *pa], timeout=10)
        check(res, a)
        assert set(res.contributors) == {p for p, _ in pa}
        # pb either answered before the download ended (dropped, with why) or was not waited for
        assert "holds a different state" in res.dropped.get(pb[0], "holds a different state")


async def test_a_slow_provider_does_not_gate_the_download_and_joins_when_it_answers(swarm):
    async with asyncio.timeout(20):
        snap = snapshot()
        gate = asyncio.Event()

        async def slow_snapshot():
            await gate.wait()  # a provider still copying and hashing its state
            return snap

        fast = [(await swarm.provider(snap))[0] for _ in range(2)]
        slow, server, _ = await swarm.provider()
        server.provide(KEY, slow_snapshot)
        me = await swarm.host()
        # 2 of 3 agree: the download starts (and here ends) without the slow one
        res = await fetch_state(me, KEY, [slow, *fast], timeout=10, rpc_timeout=10)
        check(res, snap)
        assert set(res.contributors) == {p for p, _ in fast} and slow[0] not in res.dropped
        # a provider that answers while chunks are still missing gets its share: here the two
        # that answered at once deliver one chunk each, then stall; the late one does the rest
        gate.set()
        blocked = [(await swarm.provider(snap, Blocking, before=1)) for _ in range(2)]
        late_gate = asyncio.Event()

        async def late_snapshot():
            await late_gate.wait()
            return snap

        late, late_server, _ = await swarm.provider()
        late_server.provide(KEY, late_snapshot)
        fetch = asyncio.create_task(fetch_state(me, KEY, [late, *(b[0] for b in blocked)], timeout=15,
                                                rpc_timeout=10, stall_timeout=1.0))
        for _, server, _ in blocked:
            await server.reached.wait()  # both fast providers are into the download, then stall
        late_gate.set()
        res = await fetch
        check(res, snap)
        assert res.contributors[late[0]] == snap[0].num_chunks - 2
        assert all("failed mid-transfer" in res.dropped[b[0][0]] for b in blocked)


async def test_ties_go_to_the_larger_epoch_then_the_lowest_id(swarm):
    async with asyncio.timeout(10):
        a, b = snapshot(0, epoch=3), snapshot(1, epoch=7)
        provs = [(await swarm.provider(a))[0], (await swarm.provider(b))[0]]
        me = await swarm.host()
        assert (await fetch_state(me, KEY, provs, timeout=10)).manifest.id == b[0].id
        c, d = snapshot(2, epoch=5), snapshot(3, epoch=5)
        provs = [(await swarm.provider(c))[0], (await swarm.provider(d))[0]]
        assert (await fetch_state(me, KEY, provs, timeout=10)).manifest.id == min(c[0].id, d[0].id)


async def test_pinned_manifest_and_previous_snapshots(swarm):
    async with asyncio.timeout(10):
        a, b, c = snapshot(0, epoch=1), snapshot(1, epoch=2), snapshot(2, epoch=3)
        entry, server, _ = await swarm.provider(a)
        others = [(await swarm.provider(a))[0] for _ in range(2)]
        server.publish(KEY, *b)  # a is still held as the previous snapshot
        me = await swarm.host()
        res = await fetch_state(me, KEY, [entry, *others], manifest_id=b[0].id, timeout=10)
        check(res, b)
        res = await fetch_state(me, KEY, [entry, *others], manifest_id=a[0].id, timeout=10)
        check(res, a)
        assert set(res.contributors) == {entry[0], *(p for p, _ in others)}
        server.publish(KEY, *c)  # keep=2: a is gone from this provider
        res = await fetch_state(me, KEY, [entry], manifest_id=c[0].id, timeout=10)
        check(res, c)
        with pytest.raises(NoProviderError, match="holds manifest"):
            await fetch_state(me, KEY, [entry], manifest_id=a[0].id, timeout=10)


# ---------------------------------------------------------------------------- errors and timeouts


async def test_no_provider_with_the_state_fails_fast_and_clearly(swarm):
    async with asyncio.timeout(10):
        empty = (await swarm.provider())[0]
        dead_host = await swarm.host()
        dead = (dead_host.peer_id, ("127.0.0.1", dead_host.listen_port))
        await dead_host.close()
        me = await swarm.host()
        t0 = time.monotonic()
        with pytest.raises(NoProviderError) as info:
            await fetch_state(me, KEY, [empty, dead], timeout=5)
        assert time.monotonic() - t0 < 3
        msg = str(info.value)
        assert "'run/state'" in msg and "holds no state" in msg and "unreachable" in msg
        with pytest.raises(StateTransferError, match="none of 0 providers"):
            await fetch_state(me, KEY, [], timeout=5)
        # a state larger than the caller accepts: refused before allocation, not blamed on the peer
        entry = (await swarm.provider(snapshot()))[0]
        with pytest.raises(NoProviderError, match="too large here"):
            await fetch_state(me, KEY, [entry], max_total=1 << 20, timeout=5)


async def test_timeout_is_a_clear_error_within_the_deadline(swarm):
    async with asyncio.timeout(10):
        stalled = (await swarm.provider(snapshot(), cls=Blocking))[0]
        t0 = time.monotonic()
        with pytest.raises(StateTimeoutError, match="timed out after 0.3 s while downloading .* still missing"):
            await fetch_state(await swarm.host(), KEY, [stalled], stall_timeout=30, timeout=0.3)
        assert time.monotonic() - t0 < 1.3


# ---------------------------------------------------------------------------- the server


async def test_server_rejects_bad_requests_and_closes_cleanly(swarm):
    async with asyncio.timeout(10):
        snap = snapshot()
        entry, server, host = await swarm.provider(snap)
        me = await swarm.host()
        with pytest.raises(RPCError, match="malformed"):
            await me.call(entry[0], entry[1], MANIFEST_METHOD, ["not", "a", "map"])
        with pytest.raises(RPCError, match="state key"):
            await me.call(entry[0], entry[1], MANIFEST_METHOD, {"key": "x" * 1000})
        assert await me.call(entry[0], entry[1], MANIFEST_METHOD, {"key": "other"}) is None
        conn = me.connection(entry[0])
        m = snap[0]
        for header, why in [
            ("junk", "malformed header"),
            ({"key": KEY, "id": b"\x00" * 32, "first": 0, "count": 1}, "no longer held"),
            ({"key": KEY, "id": m.id, "first": m.num_chunks, "count": 1}, "out of bounds"),
            ({"key": KEY, "id": m.id, "first": 0, "count": 0}, "out of bounds"),
            ({"key": KEY, "id": m.id, "first": "0", "count": 1}, "out of bounds"),
        ]:
            stream = await conn.open_stream(CHUNKS_PROTOCOL, header)
            with pytest.raises(StreamReset, match=why):
                await stream.read(5)
        # close() cancels a stream it is serving and unregisters its handlers
        blocking = Blocking(host)
        await server.close()
        await blocking.start()
        blocking.publish(KEY, *snap)
        stream = await conn.open_stream(CHUNKS_PROTOCOL, {"key": KEY, "id": m.id, "first": 0, "count": 2})
        await blocking.reached.wait()
        await blocking.close()
        with pytest.raises(StreamReset):
            await stream.read(5)
        with pytest.raises(RPCError, match="unknown method"):
            await me.call(entry[0], entry[1], MANIFEST_METHOD, {"key": KEY})
        with pytest.raises(RuntimeError, match="closed"):
            server.publish(KEY, *snap)
        with pytest.raises(ValueError, match="buffer holds"):
            StateServer(host).publish(KEY, snap[0], snap[1][:-1])


# ---------------------------------------------------------------------------- the schedule (sans-IO)


def test_chunk_schedule_hands_out_segments_and_requeues_failures():
    s = ChunkSchedule(10, 4)
    assert s.take("a") == (0, 4) and s.take("b") == (4, 8) and s.take("c") == (8, 10)
    s.verified("a", 0)
    s.verified("a", 1)
    s.failed("a")  # 2..3 back at the front
    assert s.missing() == [(2, 4), (4, 8), (8, 10)]
    with pytest.raises(RuntimeError, match="out of order"):
        s.verified("b", 5)
    for i in range(4, 8):
        s.verified("b", i)
    s.done("b")
    assert s.take("b") == (2, 4)
    s.failed("c")
    s.failed("c")  # idempotent
    assert not s.idle and not s.complete
    for i in (2, 3):
        s.verified("b", i)
    s.done("b")
    assert s.take("b") == (8, 10)
    s.verified("b", 8)
    s.verified("b", 9)
    s.done("b")
    assert s.complete and s.idle and s.take("a") is None
    assert dict(s.chunks_from) == {"a": 2, "b": 8}


async def test_snapshot_waits_for_the_round_in_flight_to_settle():
    """A state request that arrives while a round is in flight is answered with the state after
    it (the epoch the swarm is about to train), not the one whose round is closing."""
    import threading

    from p2ptrain.optim.state_sync import StateSync

    lock, settled = threading.Lock(), threading.Event()
    state = {"epoch": 4, "w": torch.zeros(1000)}
    sync = StateSync(None, "k", lambda: (state["epoch"], {"w": state["w"]}), lock,  # type: ignore[arg-type]
                     settled=settled, settle_timeout=30.0)
    refresh = asyncio.ensure_future(sync._refresh())
    # the round is still running: without the wait the snapshot (of epoch 4) is taken in ~1 ms
    done, _ = await asyncio.wait([refresh], timeout=0.3)
    assert not done
    with lock:  # the round's update lands
        state["epoch"], state["w"] = 5, torch.ones(1000)
    settled.set()
    async with asyncio.timeout(10):
        await refresh
    manifest = sync.server.latest("k")
    assert manifest is not None and manifest.meta["epoch"] == 5
    (source,) = sync.server._snapshots["k"]
    assert torch.equal(source.read(0, 4000).view(torch.float32), torch.ones(1000))
    # no round in flight: answered at once (and not rebuilt for the same epoch)
    async with asyncio.timeout(2):
        await sync._refresh()
    assert sync.server.latest("k") is manifest


async def test_snapshot_follows_a_state_change_that_keeps_the_epoch():
    """A state-averaging round changes the parameters, not the epoch: the snapshot served after it
    must be of the new values, not the one cached for the epoch before the round."""
    import threading

    from p2ptrain.optim.state_sync import StateSync

    lock = threading.Lock()
    state = {"epoch": 5, "version": 0, "w": torch.zeros(1000)}
    sync = StateSync(None, "k", lambda: (state["epoch"], {"w": state["w"]}), lock,  # type: ignore[arg-type]
                     version=lambda: state["version"])
    async with asyncio.timeout(10):
        await sync._refresh()
        before = sync.server.latest("k")
        await sync._refresh()  # nothing changed: the same snapshot
        assert sync.server.latest("k") is before
        with lock:  # the state round's average lands: same epoch, new values
            state["w"], state["version"] = torch.full((1000,), 0.5), 1
        await sync._refresh()
    after = sync.server.latest("k")
    assert after is not None and before is not None
    assert after.meta["epoch"] == before.meta["epoch"] == 5 and after.digests != before.digests
    (source,) = sync.server._snapshots["k"]  # the stale one is dropped (nobody reads it)
    assert torch.equal(source.read(0, 4000).view(torch.float32), torch.full((1000,), 0.5))


def test_short_gil_waits_lowers_the_switch_interval_and_restores_it_when_the_last_burst_ends():
    import sys
    import threading

    from p2ptrain.gil import short_gil_waits

    before = sys.getswitchinterval()
    inside = threading.Event()
    release = threading.Event()

    def other_burst() -> None:
        with short_gil_waits():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_burst)
    with short_gil_waits(1e-4):
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        t.start()
        assert inside.wait(10)
    # the other thread's burst is still on: the interval stays short
    assert sys.getswitchinterval() < before
    release.set()
    t.join(10)
    assert sys.getswitchinterval() == pytest.approx(before)


def test_snapshot_restores_the_switch_interval_even_when_it_fails():
    import sys

    before = sys.getswitchinterval()
    with pytest.raises(StateTooLarge):
        build_snapshot({"w": torch.zeros(1000)}, max_total=100)
    assert sys.getswitchinterval() == pytest.approx(before)
