"""Checkpoints in the swarm: announcements, the signed "latest" record, multi-provider fetch with
resume, and a checkpoint saved in one process fetched by another.

In-process tests run several DHT nodes (each with its own store) in one event loop, bounded by
``asyncio.timeout``; the cross-process test runs this file as a provider child (see ``_child``).
Nothing here waits on a sleep: hooks and progress callbacks signal events.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from dht import DHTConfig, DHTNode, Identity, InvalidRecord, Multiaddr
from p2ptrain.checkpoint import StateServer, StateTimeoutError, build_snapshot, restore
from p2ptrain.checkpoint.directory import latest_key, latest_value, provider_value, providers_key
from p2ptrain.checkpoint.record import CheckpointRecord
from p2ptrain.checkpoint.store import CheckpointStore
from p2ptrain.checkpoint.swarm import (
    CheckpointService,
    CheckpointUnavailable,
    announce,
    download_checkpoint,
    fetch_checkpoint,
    find_latest,
    find_providers,
)

RUN = "ckpt-test"
CHUNK = 64 << 10
FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=3.0, maintenance_period=0.5)


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "params": [torch.randn(300_000, generator=g), torch.randn(33, 7, generator=g).to(torch.bfloat16)],
        "inner": {"state": {0: {"step": torch.tensor(float(seed)), "idx": torch.arange(20_000)}},
                  "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "empty": torch.empty(0, 3),
    }


def snapshot(seed: int = 0, epoch: int = 1):
    return build_snapshot(make_state(seed), {"epoch": epoch}, chunk_size=CHUNK)


def assert_state_equal(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        # bytes, not values: bit-exact (NaN payloads and -0.0 included)
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for k in want:
            assert_state_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_state_equal(a, b)
    else:
        assert got == want


class Peer:
    """A DHT node with a store, optionally serving it (CheckpointService)."""

    def __init__(self, node: DHTNode, store: CheckpointStore):
        self.node = node
        self.store = store
        self.service: CheckpointService | None = None

    async def serve(self, server: StateServer | None = None) -> CheckpointService:
        self.service = CheckpointService(self.node, self.store, run_id=RUN, server=server, ttl=60)
        await self.service.start()
        return self.service

    def save(self, seed: int = 0, epoch: int = 1):
        m, buf = snapshot(seed, epoch)
        return self.store.save(m, buf, run_id=RUN, epoch=epoch, identity=self.node.identity)


@pytest.fixture
async def peers(tmp_path, loop_errors):
    made: list[Peer] = []
    servers: list[StateServer] = []

    async def make(n: int) -> list[Peer]:
        new = []
        for _ in range(n):
            node = DHTNode(config=FAST)
            await node.start([made[0].node.multiaddrs[0]] if made else [])
            peer = Peer(node, CheckpointStore(tmp_path / f"peer{len(made)}"))
            made.append(peer)
            new.append(peer)
        return new

    make.servers = servers  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for p in made:
            if p.service is not None:
                await p.service.close()
        for s in servers:
            await s.close()
        await asyncio.gather(*(p.node.close() for p in made), return_exceptions=True)


# ---------------------------------------------------------------------------- DHT records


async def test_announce_then_find_latest_and_providers(peers):
    async with asyncio.timeout(20):
        a, b, c = await peers(3)
        assert await find_latest(c.node, RUN) is None
        info1 = a.save(0, epoch=3)
        await announce(a.node, a.store, info1)
        info2 = b.save(1, epoch=5)
        await announce(b.node, b.store, info2)
        assert await find_latest(c.node, RUN) is None  # one writer's claim alone is nobody's latest
        both = {a.node.peer_id, b.node.peer_id}
        latest = await find_latest(c.node, RUN, trusted=both)
        assert latest == info2.record  # newer epoch wins among the writers believed
        provs = await find_providers(c.node, RUN, info1.manifest_id)
        assert [(p.peer, p.record) for p in provs] == [(a.node.peer_id, info1.record)]
        assert provs[0].addr == (a.node.multiaddrs[0].host, a.node.multiaddrs[0].port)
        # a's own newer save replaces its latest entry (one sub-key per writer)
        info3 = a.save(2, epoch=8)
        await announce(a.node, a.store, info3)
        assert await find_latest(c.node, RUN, trusted=both) == info3.record


async def test_forged_latest_records_are_ignored_and_logged_once(peers, caplog):
    async with asyncio.timeout(20):
        writer, mallory, reader = await peers(3)
        info = writer.save(0, epoch=5)
        await announce(writer.node, writer.store, info)
        key, expiration = latest_key(RUN), time.time() + 60
        real = info.record
        # the DHT itself refuses a write to the writer's own sub-key by anyone else
        with pytest.raises(InvalidRecord, match="owned by another peer"):
            await mallory.node.store(key, latest_value(real), expiration,
                                     subkey=writer.node.owned("ckpt"))
        # so the forgeries go under mallory's own sub-key:
        tampered = dataclasses.replace(real, epoch=99)  # epoch raised after signing
        stolen = CheckpointRecord.sign(writer.node.identity, run_id=RUN, epoch=50, manifest_id=b"\x01" * 32, size=1)
        other_run = CheckpointRecord.sign(mallory.node.identity, run_id="other-run", epoch=70,
                                          manifest_id=b"\x02" * 32, size=1)
        caplog.set_level(logging.WARNING, logger="p2ptrain.checkpoint")
        for value in (latest_value(tampered), latest_value(stolen), latest_value(other_run), {"v": 1, "r": b"junk"},
                      "x"):
            await mallory.node.store(key, value, expiration, subkey=mallory.node.owned("ckpt"))
            expiration += 1  # each write must be newer than the last to replace it
            assert await find_latest(reader.node, RUN, trusted={writer.node.peer_id}) == real
            assert await find_latest(reader.node, RUN, trusted={writer.node.peer_id}) == real
        warnings = [r.getMessage() for r in caplog.records if "ignoring a checkpoint entry" in r.getMessage()]
        assert len(warnings) == 5, warnings  # one per forgery, however often it is read
        assert "signature does not verify" in warnings[0]
        assert "under its own name" in warnings[1] and "for run 'other-run'" in warnings[2]
        # a provider entry whose record is forged is ignored too; the writer's own entry stands
        await mallory.node.store(providers_key(RUN, real.manifest_id), provider_value(("127.0.0.1", 9), tampered),
                                 time.time() + 60, subkey=mallory.node.owned("prov"))
        assert [p.peer for p in await find_providers(reader.node, RUN, real.manifest_id)] == [writer.node.peer_id]


# ---------------------------------------------------------------------------- fetching


class CorruptSource:
    """Serves a checkpoint with one byte of every chunk flipped (a lying provider)."""

    def __init__(self, store: CheckpointStore, manifest):
        self.store, self.manifest = store, manifest

    async def chunk(self, index: int) -> bytes:
        data = bytearray(self.store.read_chunk(self.manifest, index))
        data[0] ^= 0xFF
        return bytes(data)


class Gated(StateServer):
    """Sends ``allow`` chunks, then signals ``reached`` and holds further chunks until ``gate``."""

    def __init__(self, host, allow: int):
        super().__init__(host)
        self.allow, self.sent = allow, 0
        self.reached, self.gate = asyncio.Event(), asyncio.Event()

    async def _before_chunk(self, key: str, index: int) -> None:
        if self.sent >= self.allow and not self.gate.is_set():
            self.reached.set()
            await self.gate.wait()
        self.sent += 1


async def test_fetch_from_several_providers_bit_exact_and_resumes_nothing_twice(peers):
    async with asyncio.timeout(30):
        a, b, c, me = await peers(4)
        info = a.save(0, epoch=4)
        for p in (b, c):  # the same state, saved by the epoch's other writers
            assert p.save(0, epoch=4).manifest_id == info.manifest_id
        for p in (a, b, c):
            await p.serve()
            await announce(p.node, p.store, info)
        seen: list[tuple[int, int]] = []
        got = await fetch_checkpoint(me.node, me.store, run_id=RUN, progress=lambda d, t: seen.append((d, t)))
        assert got.manifest_id == info.manifest_id and got.record == c.store.latest(RUN).record
        m, buf = me.store.load(got.manifest_id)
        assert_state_equal(restore(m, buf), make_state(0))
        assert seen[-1] == (m.total_size, m.total_size) and len(seen) > m.num_chunks // 2
        # every provider served (their records name different writers; the newest one was kept)
        provs = await find_providers(me.node, RUN, info.manifest_id)
        assert {p.peer for p in provs} == {a.node.peer_id, b.node.peer_id, c.node.peer_id}
        # fetching what the store holds is free: no provider is asked
        assert (await fetch_checkpoint(me.node, me.store, run_id=RUN, manifest_id=info.manifest_id)) == got


async def test_corrupt_provider_is_dropped_and_its_chunks_fetched_elsewhere(peers):
    async with asyncio.timeout(30):
        good1, good2, liar, me = await peers(4)
        info = good1.save(0, epoch=2)
        for p in (good2, liar):
            p.save(0, epoch=2)
        await good1.serve()
        await good2.serve()
        server = StateServer(liar.node.host)
        peers.servers.append(server)
        await server.start()
        manifest = liar.store.manifest(info.manifest_id)

        async def lying(key: str):
            return [CorruptSource(liar.store, manifest)]
        server.add_resolver(lying)
        for p in (good1, good2, liar):
            await announce(p.node, p.store, p.store.latest(RUN))
        providers = await find_providers(me.node, RUN, info.manifest_id)
        assert len(providers) == 3
        result = await download_checkpoint(me.node, me.store, info.record, providers, timeout=20)
        assert result.corrupt == {liar.node.peer_id}
        assert "does not match its digest" in result.dropped[liar.node.peer_id]
        assert liar.node.peer_id not in result.contributors
        assert sum(result.contributors.values()) == manifest.num_chunks == result.downloaded
        m, buf = me.store.load(info.manifest_id)
        assert_state_equal(restore(m, buf), make_state(0))


async def test_interrupted_fetch_resumes_without_downloading_verified_chunks_again(peers):
    async with asyncio.timeout(30):
        provider, me = await peers(2)
        info = provider.save(3, epoch=7)
        allow = 5
        server = Gated(provider.node.host, allow)
        peers.servers.append(server)
        await server.start()
        await provider.serve(server)
        await announce(provider.node, provider.store, info)
        stored = asyncio.Event()

        def progress(done: int, total: int) -> None:
            if done >= allow * CHUNK:
                stored.set()
        trusted = {provider.node.peer_id}  # the only writer: believed because we trust it
        fetch = asyncio.create_task(fetch_checkpoint(me.node, me.store, run_id=RUN, progress=progress,
                                                     trusted=trusted))
        await stored.wait()  # `allow` chunks verified and on disk; the provider holds back the rest
        assert server.reached.is_set()
        fetch.cancel()  # the fetching process dies
        with pytest.raises(asyncio.CancelledError):
            await fetch
        m = provider.store.manifest(info.manifest_id)
        assert me.store.latest(RUN) is None  # not committed: invisible
        assert len(me.store.missing_chunks(m)) == m.num_chunks - allow
        # a timeout is the other way a fetch stops half-way: a clear error, chunks kept
        with pytest.raises(StateTimeoutError, match="timed out"):
            await fetch_checkpoint(me.node, me.store, run_id=RUN, timeout=1.0, trusted=trusted)
        assert len(me.store.missing_chunks(m)) == m.num_chunks - allow
        missing = me.store.missing_chunks(m)
        server.bytes_sent = 0  # what reaches the wire (streams of the dead fetches were reset)
        server.gate.set()
        providers = await find_providers(me.node, RUN, info.manifest_id)
        result = await download_checkpoint(me.node, me.store, info.record, providers, timeout=20)
        assert result.downloaded == len(missing) == m.num_chunks - allow and result.reused == allow
        assert server.bytes_sent == sum(b - a for a, b in map(m.chunk_span, missing))
        m2, buf = me.store.load(info.manifest_id)
        assert_state_equal(restore(m2, buf), make_state(3))


async def test_nothing_announced_is_a_clear_error(peers):
    async with asyncio.timeout(20):
        a, me = await peers(2)
        with pytest.raises(CheckpointUnavailable, match=f"no checkpoint of run '{RUN}' is announced"):
            await fetch_checkpoint(me.node, me.store, run_id=RUN)
        info = a.save(0, epoch=1)
        await announce(a.node, a.store, info)
        await a.node.close()  # its entries linger in the DHT, it does not
        with pytest.raises(Exception, match="unreachable|none of 1 providers"):
            await fetch_checkpoint(me.node, me.store, run_id=RUN, timeout=10, trusted={a.node.peer_id})
        with pytest.raises(CheckpointUnavailable, match="no peer announces checkpoint"):
            await fetch_checkpoint(me.node, me.store, run_id=RUN, manifest_id=b"\x05" * 32)


async def test_checkpointer_finds_the_newest_fetching_it_when_only_the_swarm_has_it(peers):
    from p2ptrain.checkpoint.autosave import Checkpointer, choose_writers

    async with asyncio.timeout(30):
        a, b, me = await peers(3)
        info = a.save(4, epoch=6)
        await a.serve()
        await announce(a.node, a.store, info)
        b.save(5, epoch=2)  # an older one on our own disk
        server = StateServer(me.node.host)
        peers.servers.append(server)
        await server.start()

        class SameLoop:  # Checkpointer.find blocks; run it in a thread that submits to this loop
            def run(self, coro, timeout=None):
                return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

        loop = asyncio.get_running_loop()
        ck = Checkpointer(me.node, SameLoop(), RUN, b.store, every=3, server=server, meta={},  # type: ignore[arg-type]
                          trusted_writers=[a.node.peer_id])  # a alone wrote it
        try:
            await ck.start()
            assert (await asyncio.to_thread(ck.find, 20.0, 7)).epoch == 2  # the swarm's is older than 7: not fetched
            assert b.store.latest(RUN).epoch == 2
            found = await asyncio.to_thread(ck.find, 20.0)
            assert found.manifest_id == info.manifest_id and found.epoch == 6
            assert_state_equal(ck.load(found), make_state(4))
            await asyncio.to_thread(ck.endorse, found)  # now also under our own name
            assert {i.writer for i in b.store.infos(info.manifest_id)} == {a.node.peer_id, me.node.peer_id}
        finally:
            await ck.close()
    # the writers of an epoch: the same on every peer given the same view, and rotating
    ids = [Identity().peer_id for _ in range(6)]
    assert choose_writers(ids, 10, 2) == choose_writers(list(reversed(ids)), 10, 2)
    assert len({tuple(choose_writers(ids, e, 2)) for e in range(20)}) > 3
    assert choose_writers(ids[:1], 3, 2) == ids[:1]


async def test_a_save_due_while_one_is_written_waits_for_it_unless_the_state_moved_on(peers):
    """Epochs faster than the disk: the newest due save waits behind the one in flight and is
    written when the disk is free (a run's last checkpoint is never lost that way); one whose
    epoch the state has left by then is dropped, counted in ``skipped``."""
    import threading

    from p2ptrain.checkpoint.autosave import Checkpointer

    async with asyncio.timeout(30):
        (a,) = await peers(1)
        ck = Checkpointer(a.node, None, RUN, a.store, every=1, server=StateServer(a.node.host), meta={})  # type: ignore[arg-type]
        now = {"epoch": 1}
        gate, reading = threading.Event(), threading.Event()

        def state():  # a save reads the state, then stays "in flight" until the gate opens
            epoch = now["epoch"]
            reading.set()
            gate.wait(10)
            return epoch, make_state(epoch)

        lock = threading.Lock()
        assert ck.maybe_save(1, [], state, lock)
        assert await asyncio.to_thread(reading.wait, 10)
        for epoch in (2, 3):  # 1 is being written; 2 waits behind it, then 3 takes its place
            now["epoch"] = epoch
            assert ck.maybe_save(epoch, [], state, lock)
        gate.set()
        info = await asyncio.to_thread(ck.flush, 20)
        assert info is not None and info.epoch == 3 and ck.saved == 2 and ck.skipped == 1
        assert [i.epoch for i in a.store.list(RUN)] == [3, 1]

        gate.clear()
        reading.clear()
        now["epoch"] = 4
        assert ck.maybe_save(4, [], state, lock)
        assert await asyncio.to_thread(reading.wait, 10)
        assert ck.maybe_save(5, [], state, lock)  # waits; by the time the disk is free the state is at 6
        now["epoch"] = 6
        gate.set()
        assert await asyncio.to_thread(ck.flush, 20) is None
        assert ck.saved == 3 and ck.skipped == 2 and a.store.latest(RUN).epoch == 4
        await asyncio.to_thread(ck.wait, 5)


async def test_a_rotten_blob_on_a_providers_disk_is_never_served(peers):
    async with asyncio.timeout(30):
        rotten, good, me = await peers(3)
        info = rotten.save(0, epoch=3)
        good.save(0, epoch=3)
        m = rotten.store.manifest(info.manifest_id)
        # bit rot in every chunk on this provider's disk: whichever segment the schedule hands it
        # (that depends on which provider answered first), its first read hits a rotten blob
        blobs = [rotten.store.blobs.path(m.chunk_digest(i)) for i in range(m.num_chunks)]
        for blob in blobs:
            data = bytearray(blob.read_bytes())
            data[100 % len(data)] ^= 1
            blob.write_bytes(bytes(data))
        for p in (rotten, good):
            await p.serve()
            await announce(p.node, p.store, p.store.latest(RUN))
        providers = await find_providers(me.node, RUN, info.manifest_id)
        result = await download_checkpoint(me.node, me.store, info.record, providers, timeout=20)
        # the provider's store caught it before sending: no bad byte went out, the other one filled in
        assert result.corrupt == set() and "failed mid-transfer" in result.dropped[rotten.node.peer_id]
        assert result.contributors[good.node.peer_id] >= 1
        assert_state_equal(restore(*me.store.load(info.manifest_id)), make_state(0))
        assert not all(b.exists() for b in blobs)  # the rotten file it read was removed (a fetch can replace it)


async def test_a_failing_sink_ends_the_fetch_without_blaming_providers(peers):
    from p2ptrain.checkpoint import StateTransferError, fetch_state

    async with asyncio.timeout(20):
        a, me = await peers(2)
        info = a.save(1, epoch=1)
        await a.serve()
        kept: list[int] = []

        async def disk_full_after_three(m, index, data):
            if len(kept) >= 3:
                raise OSError(28, "No space left on device")
            kept.append(index)

        provider = (a.node.peer_id, (a.node.multiaddrs[0].host, a.node.multiaddrs[0].port))
        with pytest.raises(StateTransferError, match="could not keep a chunk .*No space left"):
            await fetch_state(me.node.host, f"{RUN}/ckpt", [provider], manifest_id=info.manifest_id,
                              on_chunk=disk_full_after_three, timeout=10)
        assert len(kept) == 3
        with pytest.raises(ValueError, match="have= needs on_chunk="):
            await fetch_state(me.node.host, f"{RUN}/ckpt", [], have=lambda m: [])


def test_chunk_schedule_skips_held_chunks_and_token_bucket_keeps_its_rate():
    from p2ptrain.checkpoint.throttle import TokenBucket
    from p2ptrain.checkpoint.schedule import ChunkSchedule

    s = ChunkSchedule(10, 3, have=[0, 1, 4, 9, 42])
    assert s.missing() == [(2, 4), (5, 8), (8, 9)] and s.reused == 4 and not s.complete
    for seg in ((2, 4), (5, 8), (8, 9)):
        assert s.take("p") == seg
        for i in range(*seg):
            s.verified("p", i)
        s.done("p")
    assert s.complete and s.take("p") is None and s.chunks_from["p"] == 6
    assert ChunkSchedule(4, 2, have=range(4)).complete

    bucket = TokenBucket(rate=1000.0, burst=500.0)
    assert bucket.take(400, now=0.0) == 0.0  # within the burst
    assert bucket.take(600, now=0.0) == pytest.approx(0.5)  # 500 bytes of debt: half a second
    assert bucket.take(1000, now=0.5) == pytest.approx(1.0)  # the debt is paid at 0.5, this one waits 1 s
    assert bucket.take(0, now=10.0) == 0.0 and bucket.take(500, now=10.0) == 0.0  # refilled, capped at the burst
    assert bucket.take(1, now=10.0) > 0
    with pytest.raises(ValueError, match="rate must be a positive"):
        TokenBucket(0)


def test_optimizer_saves_every_n_epochs_and_a_new_one_resumes_from_disk(tmp_path):
    """Alone (it is always one of the writers), with Adam state and a scheduler; the resumed
    optimizer starts at the saved epoch with bit-identical parameters, moments and LR, and a
    model of another shape refuses the checkpoint (and starts from scratch) instead of crashing."""
    from p2ptrain import DHT, DecentralizedOptimizer

    def make(seed: int, width: int = 8):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        inner = torch.optim.Adam(model.parameters(), lr=0.05)
        opt = DecentralizedOptimizer(inner, dht=dht, run_id="ckpt-opt", target_batch_size=16, batch_size_per_step=16,
                                     checkpoint_every=3, checkpoint_dir=tmp_path / "data",
                                     scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
        return model, opt

    gen = torch.Generator().manual_seed(1)
    dht = DHT([])
    try:
        model, opt = make(0)
        while opt.epoch < 7:  # every step is a global epoch here: saves at 3 and 6
            x = torch.randn(16, 8, generator=gen)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            opt.checkpointer.flush(30)  # epochs take microseconds here; a due save would be skipped
            if opt.epoch == 6:
                saved_params = [p.detach().clone() for p in model.parameters()]
                saved_inner = copy.deepcopy(opt.inner.state_dict())
                saved_lr = opt.param_groups[0]["lr"]
        opt.close()  # waits for the save in flight
        assert opt.stats.checkpoints_saved == 2 and opt.stats.last_checkpoint_epoch == 6
        store = CheckpointStore(tmp_path / "data")
        assert [i.epoch for i in store.list("ckpt-opt")] == [6, 3]

        model2, opt2 = make(5)  # another init: everything must come from the checkpoint
        try:
            assert opt2.epoch == 6 and opt2.stats.resumed_epoch == 6
            assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), saved_params))
            assert_state_equal(opt2.inner.state_dict()["state"], saved_inner["state"])
            assert opt2.param_groups[0]["lr"] == saved_lr
        finally:
            opt2.close()
        _, opt3 = make(0, width=5)  # another model: the checkpoint does not fit
        try:
            assert opt3.epoch == 0 and opt3.stats.resumed_epoch is None
        finally:
            opt3.close()
    finally:
        dht.close()


# ---------------------------------------------------------------------------- across processes


def _child(store_dir: str, seed: int, epoch: int, bootstrap: str) -> None:
    """A provider process: saves ``make_state(seed)`` as a checkpoint, serves and announces it,
    prints one JSON line, and runs until its stdin closes."""

    async def main() -> None:
        node = DHTNode(config=FAST)
        await node.start([Multiaddr.parse(bootstrap)] if bootstrap else [])
        store = CheckpointStore(store_dir)
        m, buf = snapshot(seed, epoch)
        info = store.save(m, buf, run_id=RUN, epoch=epoch, identity=node.identity)
        async with CheckpointService(node, store, run_id=RUN, ttl=60):
            await announce(node, store, info)
            print(json.dumps({"addr": str(node.multiaddrs[0]), "manifest": info.manifest_id.hex()}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await node.close()

    asyncio.run(main())


def _spawn(store_dir, seed: int, epoch: int, bootstrap: str = "") -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, __file__, str(store_dir), str(seed), str(epoch), bootstrap],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line, f"provider child {proc.pid} exited with {proc.wait()}"
    return proc, json.loads(line)


@pytest.mark.timeout(90)
async def test_saved_in_one_process_fetched_by_another_bit_exact(tmp_path, child_pids, loop_errors):
    before = child_pids()
    procs: list[subprocess.Popen] = []
    node = DHTNode(config=FAST)
    try:
        p1, hello1 = await asyncio.to_thread(_spawn, tmp_path / "a", 7, 9)
        procs.append(p1)
        for name in ("b", "c"):  # the same state, saved by the epoch's other writers (a quorum of three)
            proc, hello = await asyncio.to_thread(_spawn, tmp_path / name, 7, 9, hello1["addr"])
            procs.append(proc)
            assert hello["manifest"] == hello1["manifest"]
        async with asyncio.timeout(60):
            await node.start([Multiaddr.parse(hello1["addr"])])
            store = CheckpointStore(tmp_path / "me")
            record = await find_latest(node, RUN)
            assert record is not None and record.epoch == 9 and record.manifest_id.hex() == hello1["manifest"]
            providers = await find_providers(node, RUN, record.manifest_id)
            assert len(providers) == 3
            result = await download_checkpoint(node, store, record, providers)
            assert set(result.contributors) == {p.peer for p in providers}  # every process served
            m, buf = store.load(record.manifest_id)
            assert m.meta == {"epoch": 9}
            assert_state_equal(restore(m, buf), make_state(7))
    finally:
        await node.close()
        for p in procs:
            p.stdin.close()  # the child's cue to leave
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs)
    assert child_pids() <= before


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
