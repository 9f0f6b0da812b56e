"""Hostile checkpoint peers (issue 27, items 2 and 9): a "latest" claim signed by one or two
colluding identities, and a manifest far larger than the fetcher expects.

Each attack comes from ``p2ptrain.testing.hostile.checkpoints`` and is met where a user meets it:
``find_latest``/``fetch_checkpoint``, a ``DecentralizedOptimizer`` resuming from the swarm's
checkpoint, ``p2ptrain ckpt get latest`` / ``ckpt ls``, and ``fetch_state``/``download_checkpoint``.
Every node listens on loopback; every wait is bounded by a timeout; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dht import DHTConfig, DHTNode
from p2ptrain import DHT, DecentralizedOptimizer
from p2ptrain.checkpoint import CheckpointRecord, StateServer, StateTooLargeError, build_snapshot, fetch_state, restore
from p2ptrain.checkpoint.directory import provider_value, providers_key, transfer_key
from p2ptrain.checkpoint.store import CheckpointStore
from p2ptrain.checkpoint.swarm import (
    CheckpointService,
    CheckpointUnavailable,
    announce,
    download_checkpoint,
    fetch_checkpoint,
    find_latest,
    find_providers,
    latest_verdict,
)
from p2ptrain.testing.hostile import MODES
from p2ptrain.testing.hostile.checkpoints import MAX_EPOCH, huge_manifest, latest_claim

pytestmark = pytest.mark.timeout(90)

RUN = "hostile-ckpt"
FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=3.0, maintenance_period=0.5)
CLI = [sys.executable, "-m", "p2ptrain"]


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"params": [torch.randn(20_000, generator=g)], "inner": {"lr": 0.05}}


class Peer:
    def __init__(self, node: DHTNode, store: CheckpointStore):
        self.node, self.store = node, store

    async def write(self, seed: int, epoch: int):
        """Save ``state(seed)`` as ``epoch``, signed by this peer, and announce it (as a writer does)."""
        m, buf = build_snapshot(state(seed), {"epoch": epoch})
        info = self.store.save(m, buf, run_id=RUN, epoch=epoch, identity=self.node.identity)
        await announce(self.node, self.store, info, ttl=60)
        return info


@pytest.fixture
async def swarm(tmp_path, loop_errors):
    """``await swarm(n)``: n more DHT nodes on loopback (the first is everyone's bootstrap), each with a store."""
    made: list[Peer] = []
    closers: list = []

    async def make(n: int) -> list[Peer]:
        for _ in range(n):
            node = DHTNode(config=FAST)
            await node.start([made[0].node.multiaddrs[0]] if made else [])
            made.append(Peer(node, CheckpointStore(tmp_path / f"peer{len(made)}")))
        return made[-n:]

    make.closers = closers  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for close in reversed(closers):
            await close()
        await asyncio.gather(*(p.node.close() for p in made), return_exceptions=True)


async def serve(swarm, peer: Peer) -> CheckpointService:
    service = CheckpointService(peer.node, peer.store, run_id=RUN, ttl=60)
    await service.start()
    swarm.closers.append(service.close)
    return service


# ---------------------------------------------------------------------------- the latest claim


async def _honest_and_colluders(swarm, epoch: int) -> tuple[list[Peer], list[Peer], Peer, object]:
    """Three writers saved ``epoch`` (the same state, as an epoch's three writers do) and serve it;
    two colluding identities sign and serve one manifest of their own as epoch 2**63-1. Returns
    (writers, colluders, a bystander, the writers' checkpoint)."""
    *writers, evil1, evil2, me = await swarm(6)
    for h in writers:
        honest = await h.write(0, epoch=epoch)
        await serve(swarm, h)
    for evil in (evil1, evil2):  # the same state and meta: one manifest, signed twice
        attack = await MODES["latest_claim"].run(evil.node, evil.store, RUN, state(666))
        swarm.closers.append(attack.close)
    return writers, [evil1, evil2], me, honest


async def test_two_colluding_identities_claiming_epoch_2_63_are_not_the_runs_latest(swarm, caplog):
    """Before: find_latest and every fetch of "latest" went to the highest epoch any one writer
    signed (then: to any two that agreed, which two identities of one party do). Now the three
    writers' agreement wins and the colluders are named in the log, once."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.checkpoint")
    async with asyncio.timeout(30):
        writers, colluders, me, honest = await _honest_and_colluders(swarm, epoch=6)
        h1 = writers[0]

        found = await find_latest(me.node, RUN)
        assert found is not None and found.epoch == 6 and found.manifest_id == honest.manifest_id
        verdict = await latest_verdict(me.node, RUN)
        assert verdict.basis == "agreed by 3 writers"
        assert [c.writers for c in verdict.refused] == [frozenset(e.node.peer_id for e in colluders)]
        assert verdict.refused[0].record.epoch == MAX_EPOCH
        named = [r.getMessage() for r in caplog.records if str(colluders[1].node.peer_id) in r.getMessage()]
        assert len(named) == 1 and "is not the run's latest" in named[0], named  # once, however often read

        got = await fetch_checkpoint(me.node, me.store, run_id=RUN, timeout=20)
        assert got.manifest_id == honest.manifest_id and got.epoch == 6
        # the evidence is kept: every writer's record, so `ckpt ls` shows it confirmed
        assert {i.writer for i in me.store.infos(honest.manifest_id)} == {h.node.peer_id for h in writers}

        # a trusted writer's one record suffices (and the attacker's stays refused)
        alone = await h1.write(1, epoch=8)
        assert await find_latest(me.node, RUN) == found
        assert await find_latest(me.node, RUN, trusted={h1.node.peer_id}) == alone.record
        # our own record is evidence for us: the attacker believes its claim, nobody else does
        assert (await find_latest(colluders[0].node, RUN)).epoch == MAX_EPOCH


async def test_writers_whose_newest_saves_differ_still_agree_on_an_older_one(swarm):
    """Some of an epoch's writers skipped their save (the previous one was still being written):
    the newest epochs then have too few records, and the run's latest is the one before, which
    every writer still lists in its entry (each entry holds a writer's few newest records)."""
    async with asyncio.timeout(30):
        h1, h2, h3, me = await swarm(4)
        agreed = await h1.write(0, epoch=4)
        await h2.write(0, epoch=4)
        await h3.write(0, epoch=4)
        await h1.write(1, epoch=6)
        await h3.write(1, epoch=6)  # two of three: not enough
        await h1.write(2, epoch=8)  # h1's entry: 8, 6, 4; h2's: 4; h3's: 6, 4
        verdict = await latest_verdict(me.node, RUN)
        assert verdict.chosen is not None and verdict.chosen.record.manifest_id == agreed.manifest_id
        assert verdict.chosen.writers == {h1.node.peer_id, h2.node.peer_id, h3.node.peer_id}
        assert [c.record.epoch for c in verdict.refused] == [8, 6]


async def test_with_only_unconfirmed_claims_fetching_latest_names_the_claimant(swarm):
    """One peer saving alone (or an attacker alone): "latest" is refused with one line that names
    the writer and the two ways out (a trusted writer, or the CID)."""
    async with asyncio.timeout(30):
        lone, me = await swarm(2)
        info = await lone.write(0, epoch=3)
        await serve(swarm, lone)
        with pytest.raises(CheckpointUnavailable) as refused:
            await fetch_checkpoint(me.node, me.store, run_id=RUN, timeout=10)
        msg = str(refused.value)
        assert "is confirmed" in msg and f"--trusted-writers {lone.node.peer_id}" in msg and "CID" in msg
        assert me.store.latest(RUN) is None
        got = await fetch_checkpoint(me.node, me.store, run_id=RUN, manifest_id=info.manifest_id, timeout=10)
        assert got.manifest_id == info.manifest_id  # by its id: the caller's choice


def test_one_identity_signing_a_claim_twice_is_one_writer():
    """Records re-signed with another ``created`` (or listed twice) add no voice: a quorum counts
    distinct writers. Our own record and a trusted writer's are evidence alone; nothing else is."""
    from dht import Identity
    from p2ptrain.checkpoint.trust import decide, parse_writers

    evil, evil2, a, b, c = Identity(), Identity(), Identity(), Identity(), Identity()

    def rec(who, epoch, mid, created=1.0):
        return CheckpointRecord.sign(who, run_id=RUN, epoch=epoch, manifest_id=mid, size=10, created=created)

    honest = [rec(w, 4, b"\x01" * 32) for w in (a, b, c)]
    spam = [rec(evil, MAX_EPOCH, b"\x02" * 32, created=t) for t in (1.0, 2.0, 3.0)]
    verdict = decide([*spam, *spam, *honest, rec(evil2, MAX_EPOCH, b"\x02" * 32)])
    assert verdict.chosen.record.epoch == 4 and verdict.basis == "agreed by 3 writers"
    assert len(verdict.refused) == 1 and len(verdict.refused[0].records) == 2  # two colluders: two voices
    assert decide(spam, me=evil.peer_id).chosen.record.epoch == MAX_EPOCH
    assert decide([*spam, *honest], trusted=parse_writers([f"{evil.peer_id},{a.peer_id}"])).chosen.record.epoch \
        == MAX_EPOCH  # whom you trust, you follow
    assert decide(spam).chosen is None and decide(honest, quorum=4).chosen is None
    with pytest.raises(ValueError, match="'12D3KooWnot-base58!' is not valid base58"):
        parse_writers(["12D3KooWnot-base58!"])


# ---------------------------------------------------------------------------- through the optimizer


def _make(dht: DHT, seed: int, store: Path, **kw) -> tuple[torch.nn.Module, DecentralizedOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), dht=dht, run_id=RUN,
                                 target_batch_size=16, batch_size_per_step=16, checkpoint_dir=store, **kw)
    return model, opt


def _three_writers(tmp_path: Path, node) -> tuple[list[torch.Tensor], list[tuple[DHT, CheckpointStore]]]:
    """A peer trains alone to epoch 3 (every step is a global epoch: a checkpoint at 3) and stops;
    two more ``node()`` s save the same checkpoint as the epoch's other writers. Returns the saved
    parameters and the three (dht, store) writers, the trainer's first; nobody serves yet."""
    trainer_dht = node()
    model, opt = _make(trainer_dht, 0, tmp_path / "w0", checkpoint_every=3)
    gen = torch.Generator().manual_seed(1)
    while opt.epoch < 3:
        x = torch.randn(16, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
    opt.checkpointer.flush(30)
    opt.close()
    first = CheckpointStore(tmp_path / "w0")
    manifest, buffer = first.load(first.latest(RUN).manifest_id)
    writers = [(trainer_dht, first)]
    for name in ("w1", "w2"):
        other_dht, other = node(), CheckpointStore(tmp_path / name)
        other.save(manifest, buffer, run_id=RUN, epoch=3, identity=other_dht.node.identity)
        writers.append((other_dht, other))
    return [p.detach().clone() for p in model.parameters()], writers


def test_an_optimizer_resuming_from_the_swarm_does_not_load_the_attackers_checkpoint(tmp_path):
    """A swarm restarts: its three writers serve epoch 3; two colluding identities serve a
    checkpoint that loads into the same model (meta copied from the honest one: the same schema)
    with parameters of 1000 and lr 1000 at epoch 10**6. Before: the new peer resumed from the
    attackers' checkpoint, lr and all. Now it resumes from the writers' checkpoint."""
    dhts: list[DHT] = []
    services: list[tuple[DHT, CheckpointService]] = []

    def node() -> DHT:
        dhts.append(DHT([str(dhts[0].multiaddrs[0])] if dhts else [], listen=("127.0.0.1", 0), config=FAST))
        return dhts[-1]

    def serve_from(dht: DHT, store: CheckpointStore) -> None:
        async def start() -> CheckpointService:
            service = CheckpointService(dht.node, store, run_id=RUN, ttl=60)
            await service.start()
            for info in store.list(RUN):
                await announce(dht.node, store, info, ttl=60)
            return service
        services.append((dht, dht.run(start(), timeout=20)))

    try:
        saved, writers = _three_writers(tmp_path, node)
        for dht, store in writers:
            serve_from(dht, store)
        manifest, buffer = writers[0][1].load(writers[0][1].latest(RUN).manifest_id)

        evil = restore(manifest, buffer, copy=True)
        evil["params"] = [torch.full_like(p, 1000.0) for p in evil["params"]]
        for group in evil["inner"]["param_groups"]:
            group["lr"] = 1000.0
        for name in ("evil1", "evil2"):
            evil_dht = node()
            attack = evil_dht.run(latest_claim(evil_dht.node, CheckpointStore(tmp_path / name), RUN, evil,
                                               meta=dict(manifest.meta), epoch=10**6), timeout=20)
            services.append((evil_dht, attack))

        model2, resumed = _make(node(), 5, tmp_path / "victim", checkpoint_every=3)
        try:
            assert resumed.stats.resumed_epoch == 3 and resumed.epoch == 3, resumed.stats
            assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), saved))
            assert resumed.param_groups[0]["lr"] == 0.05
        finally:
            resumed.close()
    finally:
        for dht, service in reversed(services):
            dht.run(service.close(), timeout=10)
        for dht in reversed(dhts):
            dht.close()


def test_a_peer_restarting_before_the_writers_waits_for_them_instead_of_resuming_older(tmp_path):
    """A whole swarm restarts: the three writers of epoch 3 announced it before the stop, and a
    peer that is not one of them comes up before any writer serves again. Before, its fetch of
    the run's latest failed at once and it started from its own older state (here: none), apart
    from the rest of the swarm; now it waits for a writer (bounded by ``load_state_timeout``)."""
    dhts: list[DHT] = []
    services: list[tuple[DHT, CheckpointService]] = []
    waiting = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting up to" in record.getMessage():
                waiting.set()

    def node() -> DHT:
        dhts.append(DHT([str(dhts[0].multiaddrs[0])] if dhts else [], listen=("127.0.0.1", 0), config=FAST))
        return dhts[-1]

    handler = Waiting()
    logging.getLogger("p2ptrain.checkpoint").addHandler(handler)
    logging.getLogger("p2ptrain.checkpoint").setLevel(logging.INFO)
    try:
        saved, writers = _three_writers(tmp_path, node)
        for dht, store in writers:  # announced before the stop; nobody serves it now
            dht.run(announce(dht.node, store, store.latest(RUN), ttl=60), timeout=20)

        result: list = []
        late = threading.Thread(target=lambda: result.append(_make(node(), 5, tmp_path / "late", checkpoint_every=3,
                                                                   load_state_timeout=30.0)))
        late.start()
        assert waiting.wait(30), "the peer did not wait for the writers"
        dht, store = writers[1]  # one writer is back

        async def serve_again() -> CheckpointService:
            service = CheckpointService(dht.node, store, run_id=RUN, ttl=60)
            await service.start()
            await announce(dht.node, store, store.latest(RUN), ttl=60)
            return service
        services.append((dht, dht.run(serve_again(), timeout=20)))
        late.join(60)
        model2, resumed = result[0]
        try:
            assert resumed.stats.resumed_epoch == 3 and resumed.epoch == 3, resumed.stats
            assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), saved))
        finally:
            resumed.close()
    finally:
        logging.getLogger("p2ptrain.checkpoint").removeHandler(handler)
        for dht, service in reversed(services):
            dht.run(service.close(), timeout=10)
        for dht in reversed(dhts):
            dht.close()


# ---------------------------------------------------------------------------- through the CLI


def _ckpt(*args: str, data: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ckpt", *args, "--data-dir", str(data)], capture_output=True, text=True, timeout=60)


async def test_ckpt_get_latest_fetches_the_agreed_checkpoint_and_ls_marks_evidence(swarm, tmp_path):
    """``p2ptrain ckpt get latest`` with two colluders at epoch 2**63-1 beside three writers: the
    writers' checkpoint is fetched (before: the attackers'), the attackers are named on stderr,
    and ``ckpt ls`` shows the fetched checkpoint confirmed by every writer."""
    async with asyncio.timeout(80):
        writers, colluders, _, honest = await _honest_and_colluders(swarm, epoch=4)
        data = tmp_path / "mine"
        got = await asyncio.to_thread(_ckpt, "get", "latest", "--run-id", RUN, "--bootstrap",
                                      str(writers[0].node.multiaddrs[0]), "--json", "--timeout", "30", data=data)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["cid"] == honest.cid
        assert all(str(e.node.peer_id) in got.stderr for e in colluders) and "is not the run's latest" in got.stderr
        listed = json.loads((await asyncio.to_thread(_ckpt, "ls", "--json", data=data)).stdout)
        assert [(e["cid"], e["confirmed"], len(e["writers"])) for e in listed] == [(honest.cid, True, 3)]
        bad = await asyncio.to_thread(_ckpt, "get", "latest", "--run-id", RUN, "--bootstrap", "/ip4/127.0.0.1/tcp/1",
                                      "--trusted-writers", "12D3Koo-not-a-peer", data=data)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--trusted-writers" in bad.stderr


# ---------------------------------------------------------------------------- sizes


async def test_a_manifest_larger_than_expected_is_refused_before_any_chunk(swarm):
    """A provider serves a 60 GiB manifest of zeros (every chunk verifies). A checkpoint download
    is sized by its record (1 MB here) and a live-state fetch by the caller's ``max_total``: both
    refuse it at once, without taking a chunk. Before, the download went on with a 64 GiB ceiling
    (on disk, or in a state-sized buffer) until it timed out."""
    async with asyncio.timeout(30):
        evil, me = await swarm(2)
        server = StateServer(evil.node.host)
        await server.start()
        swarm.closers.append(server.close)
        ckpt_source = huge_manifest(server, transfer_key(RUN))
        live_source = MODES["huge_manifest"].run(server, f"{RUN}/state", 60 << 30)
        record = CheckpointRecord.sign(evil.node.identity, run_id=RUN, epoch=5,
                                       manifest_id=ckpt_source.manifest.id, size=1 << 20)
        await evil.node.store(providers_key(RUN, record.manifest_id), provider_value(
            (evil.node.multiaddrs[0].host, evil.node.multiaddrs[0].port), record), time.time() + 60,
            subkey=evil.node.owned("prov"))
        providers = await find_providers(me.node, RUN, record.manifest_id)
        with pytest.raises(StateTooLargeError, match=r"is 64424509440 bytes, too large here: more than the 1048576"):
            await download_checkpoint(me.node, me.store, record, providers, timeout=5)
        with pytest.raises(StateTooLargeError, match="more than the 1000000 expected here"):
            await download_checkpoint(me.node, me.store, CheckpointRecord.sign(
                evil.node.identity, run_id=RUN, epoch=5, manifest_id=record.manifest_id, size=60 << 30),
                providers, timeout=5, max_size=1_000_000)
        addr = (evil.node.multiaddrs[0].host, evil.node.multiaddrs[0].port)
        with pytest.raises(StateTooLargeError, match="refused before allocating"):
            await fetch_state(me.node.host, f"{RUN}/state", [(evil.node.peer_id, addr)], max_total=50 << 20, timeout=5)
        assert ckpt_source.chunks_sent == live_source.chunks_sent == 0
        assert me.store.list() == []
