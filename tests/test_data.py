"""Datasets as content-addressed blobs: the store, the signed index, verified multi-provider
fetch (a corrupted shard is refused), and a swarm of trainers that never had the files reading
every shard about once per epoch (rendezvous assignment), with hand-over when one leaves.

In-process tests run DHT nodes in one event loop; the swarm test runs background-thread peers
(``p2ptrain.DHT``) on 127.0.0.1, each with its own store, bounded by timeouts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time

import pytest
import torch

from dht import DHTConfig, DHTNode
from p2ptrain.background import DHT
from p2ptrain.checkpoint import StateServer
from p2ptrain.data.assign import assigned, owner
from p2ptrain.data.directory import SUBKEY, dataset_key, entry_value, serve_key
from p2ptrain.data.index import DatasetError, DatasetIndex
from p2ptrain.data.records import records_of
from p2ptrain.data.store import DataStore
from p2ptrain.data.swarm import DataService, DataUnavailable, fetch_index, fetch_shard, members
from p2ptrain.data import SwarmDataset
from p2ptrain.tasks import get_task

FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=3.0, maintenance_period=0.5)
LINES = [f"record {i}: the quick brown fox jumps over the lazy dog\n" for i in range(6000)]


@pytest.fixture
def corpus(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("".join(LINES[:4000]))
    b.write_text("".join(LINES[4000:]))
    return [a, b]


def add(store: DataStore, corpus, identity):
    return store.add(corpus, "corpus", identity, shard_bytes=32 << 10, chunk_size=8 << 10)


def test_add_index_records_verify_gc(tmp_path, corpus):
    from dht import Identity

    store = DataStore(tmp_path / "s")
    index = add(store, corpus, Identity())
    assert index.format == "text" and index.records == len(LINES) and len(index.shards) > 8
    assert store.resolve(index.cid) == index.id and store.resolve("corpus") == index.id
    got = [r for i in range(len(index.shards)) for r in records_of("text", store.load_shard(index, i))]
    assert got == [line.encode() for line in LINES]  # every record, in order, once
    assert store.verify(index.id) == []
    assert store.gc() == (0, 0)  # nothing unreferenced: gc keeps every blob of a held dataset
    # a rotten chunk: verify reports it and removes the shard (a get fetches it again)
    m = store.shard_manifest(index.shards[2])
    store.blobs.path(m.chunk_digest(0)).write_bytes(b"rot" * 100)
    problems = store.verify(index.id)
    assert len(problems) == 1 and problems[0].startswith("shard 2:") and "p2ptrain data get" in problems[0]
    assert store.held(index)[2] is False and sum(store.held(index)) == len(index.shards) - 1
    store.drop(index.id)
    removed, freed = store.gc()
    assert removed > len(index.shards) and freed > 0 and store.list() == []


def test_token_arrays_are_records_of_rows(tmp_path):
    from dht import Identity
    from p2ptrain.checkpoint.safetensors_io import write_safetensors

    stream = torch.arange(10_000, dtype=torch.int32)  # 1-D: cut into rows of 100, the tail dropped
    grid = torch.arange(3000, dtype=torch.int32).view(30, 100)
    write_safetensors(tmp_path / "a.safetensors", {"tokens": stream})
    write_safetensors(tmp_path / "b.safetensors", {"ids": grid})
    store = DataStore(tmp_path / "s")
    index = store.add([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], "tok", Identity(),
                      shard_bytes=8000, row=100)
    assert index.format == "tokens" and index.records == 130 and len(index.shards) == 7  # 20 rows a shard
    rows = [r for i in range(len(index.shards)) for r in records_of("tokens", store.load_shard(index, i))]
    assert torch.equal(torch.stack(rows), torch.cat([stream.view(100, 100), grid]))
    write_safetensors(tmp_path / "c.safetensors", {"x": torch.zeros(4, 7, dtype=torch.int32)})
    with pytest.raises(DatasetError, match="one row shape"):
        store.add([tmp_path / "a.safetensors", tmp_path / "c.safetensors"], "bad", Identity(), row=100)
    with pytest.raises(DatasetError, match="mixing"):
        store.add([tmp_path / "a.safetensors", tmp_path / "x.txt"], "bad", Identity())


def test_forged_index_is_refused(tmp_path, corpus):
    from dht import Identity

    index = add(DataStore(tmp_path / "s"), corpus, Identity())
    forged = dataclasses.replace(index, name="other")  # same signature, different content
    with pytest.raises(DatasetError, match="signature does not verify"):
        DatasetIndex.from_manifest(forged.manifest())
    with pytest.raises(DatasetError, match="where dataset"):
        DatasetIndex.from_manifest(index.manifest(), expected_id=bytes(32))


def test_rendezvous_covers_each_shard_once_and_moves_only_the_leavers():
    from dht import Identity

    peers = [Identity().peer_id for _ in range(5)]
    did, n = b"d" * 32, 400
    per = [assigned(did, 3, n, peers, p) for p in peers]
    counts = collections.Counter(i for mine in per for i in mine)
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}
    assert min(map(len, per)) > n / 5 * 0.6  # about even
    gone = peers[0]
    for i in range(n):  # a leaver's shards move; nobody else's do
        before, after = owner(did, 3, i, peers), owner(did, 3, i, peers[1:])
        assert after == before or before == gone


@pytest.fixture
async def nodes(loop_errors):
    made: list[DHTNode] = []

    async def make(k: int) -> list[DHTNode]:
        for _ in range(k):
            node = DHTNode(config=FAST)
            await node.start([made[0].multiaddrs[0]] if made else [])
            made.append(node)
        return made[-k:]

    try:
        yield make
    finally:
        await asyncio.gather(*(n.close() for n in made), return_exceptions=True)


async def test_corrupted_shard_is_refused_and_fetched_from_an_honest_peer(tmp_path, corpus, nodes):
    async with asyncio.timeout(30):
        a, mallory, b = await nodes(3)
        sa, sb = DataStore(tmp_path / "a"), DataStore(tmp_path / "b")
        index = add(sa, corpus, a.identity)
        # mallory serves shard 1 with one byte flipped, under the right manifest
        m, buf = sa.ckpt.load(index.shards[1].id)
        buf[100] ^= 0xFF
        server = StateServer(mallory.host)
        await server.start()
        server.publish(serve_key(m.id), m, buf)
        held = [True] * len(index.shards)
        await mallory.store_owned(dataset_key(index.id), SUBKEY, entry_value(
            (mallory.multiaddrs[0].host, mallory.multiaddrs[0].port), held, False), time.time() + 60)
        async with DataService(a, sa, index):
            assert await fetch_index(b, sb, index.id) == index
            everyone = await members(b, index.id, len(index.shards))
            only_mallory = [x for x in everyone if x.peer == mallory.peer_id]
            with pytest.raises(DataUnavailable, match=f"shard 1: .*{mallory.peer_id.short()[-6:]}"):
                await fetch_shard(b, sb, index, 1, only_mallory)
            assert not sb.has_shard(index.shards[1])  # nothing of it committed
            got = await fetch_shard(b, sb, index, 1, everyone)
            assert a.peer_id in got and mallory.peer_id not in got
            assert torch.equal(sb.load_shard(index, 1), sa.load_shard(index, 1))
        await server.close()


async def test_unknown_cid_and_gone_providers_say_what_to_do(tmp_path, nodes):
    async with asyncio.timeout(20):
        (b,) = await nodes(1)
        with pytest.raises(DataUnavailable, match="no peer announces dataset .* check the CID"):
            await fetch_index(b, DataStore(tmp_path / "b"), b"\x01" * 32, timeout=5)


def test_four_peers_train_from_a_cid_they_never_had(tmp_path, corpus):
    """One peer adds the corpus; four others fetch it from the swarm (and from each other),
    read each shard once in epoch 0 between them, train char_lm on it; one leaves and the
    other three cover every shard in the next epoch."""
    seed = DHT([], listen=("127.0.0.1", 0), config=FAST)
    peers: list[DHT] = []
    datasets: list[SwarmDataset] = []
    try:
        store = DataStore(tmp_path / "seed")
        index = add(store, corpus, seed.node.identity)
        service = DataService(seed.node, store, index)
        seed.run(service.start(), timeout=10)
        boot = [seed.multiaddrs[0]]
        for k in range(4):
            peers.append(DHT(boot, listen=("127.0.0.1", 0), config=FAST))
        for k, p in enumerate(peers):  # all announce as trainers before any reads its assignment
            datasets.append(SwarmDataset(p, index.cid, data_dir=tmp_path / f"p{k}", epochs=1, refresh=60, timeout=30))
        task = get_task("char_lm", corpus="grammar", corpus_bytes=1 << 16, context=32, d_model=32, layers=1)
        losses: dict[int, list[float]] = {}
        errors: list[BaseException] = []

        def train(k: int) -> None:
            try:
                model = task.make_model(seed=0)
                opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
                losses[k] = []
                for x, y in task.record_batches(iter(datasets[k]), 16):
                    loss = task.loss(model, (x, y))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses[k].append(float(loss.detach()))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=train, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        reads = collections.Counter(i for d in datasets for i in d.read[0])
        assert sorted(reads) == list(range(len(index.shards))) and set(reads.values()) == {1}  # coverage: once each
        # each read exactly its rendezvous share (which may be empty: 11 shards over 4 peers leave
        # one without a shard in about 1 run in 6), and those that read something learned
        ids = [p.peer_id for p in peers]
        assert [sorted(d.read[0]) for d in datasets] == [sorted(assigned(index.id, 0, len(index.shards), ids, me))
                                                          for me in ids]
        assert all(len(losses[k]) > 3 and losses[k][-1] < losses[k][0] for k, d in enumerate(datasets) if d.read[0])
        # peer 3 leaves: the other three cover every shard of epoch 1 between them
        datasets[3].close()
        epoch1 = [set(d.assignment(1)) for d in datasets[:3]]
        assert set().union(*epoch1) == set(range(len(index.shards))) and sum(map(len, epoch1)) == len(index.shards)
        for d in datasets[:3]:  # what they fetched they serve: the swarm holds it without the seed
            assert all(d.store.has_shard(index.shards[i]) for i in d.read[0])
    finally:
        for d in datasets:
            d.close()
        for p in peers:
            p.close()
        seed.close()


def test_cli_add_serve_then_get_and_train_from_the_cid_in_other_processes(tmp_path, corpus):
    """The README's three commands, as processes on 127.0.0.1: add and serve on one, get and
    peer --dataset on others; a CID nobody serves is a one-line error saying what to check."""
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "p2ptrain", "-v"]
    seed = subprocess.Popen([*cli, "data", "add", *map(str, corpus), "--name", "corpus", "--shard-size", "65536",
                             "--data-dir", str(tmp_path / "seed"), "--serve", "--listen", "/ip4/127.0.0.1/tcp/0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cid = seed.stdout.readline().strip()
        addr = ""
        while not addr:
            line = seed.stderr.readline()
            assert line, "the seed exited before serving"
            if line.startswith("serving "):
                addr = line.split(" at ", 1)[1].strip()
        got = subprocess.run([*cli, "data", "get", cid, "--bootstrap", addr, "--data-dir", str(tmp_path / "g")],
                             capture_output=True, text=True, timeout=60)
        assert got.returncode == 0 and got.stdout.strip() == cid, got.stderr
        ok = subprocess.run([*cli, "data", "verify", cid, "--data-dir", str(tmp_path / "g")], capture_output=True,
                            text=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        peer = subprocess.run([*cli, "peer", "--example", "char_lm", "--dataset", cid, "--bootstrap", addr,
                               "--epochs", "2", "--target-batch-size", "64", "--wait-peers", "1", "--json",
                               "--threads", "1", "--data-dir", str(tmp_path / "p"), "--listen",
                               "/ip4/127.0.0.1/tcp/0"], capture_output=True, text=True, timeout=90)
        assert peer.returncode == 0, peer.stderr[-2000:]
        done = json.loads(peer.stdout.strip().splitlines()[-1])
        assert done["event"] == "done" and done["epoch"] == 2 and done["steps"] > 0
        unknown = "bafkr4i" + "a" * 52
        bad = subprocess.run([sys.executable, "-m", "p2ptrain", "data", "get", unknown, "--bootstrap", addr,
                              "--data-dir", str(tmp_path / "g")], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "no peer announces dataset" in bad.stderr
    finally:
        seed.terminate()
        seed.wait(10)


def test_a_peer_leaving_mid_epoch_hands_its_shards_over(tmp_path, corpus):
    seed = DHT([], listen=("127.0.0.1", 0), config=FAST)
    peers, sets = [], []
    try:
        store = DataStore(tmp_path / "seed")
        index = add(store, corpus, seed.node.identity)
        seed.run(DataService(seed.node, store, index).start(), timeout=10)
        peers = [DHT([seed.multiaddrs[0]], listen=("127.0.0.1", 0), config=FAST) for _ in range(2)]
        sets = [SwarmDataset(p, index.id, data_dir=tmp_path / f"p{k}", refresh=0, timeout=30)
                for k, p in enumerate(peers)]
        a, b = sets
        mine = a.assignment(0)
        assert 0 < len(mine) < len(index.shards)  # b holds the rest
        order = a.epoch_shards(0)
        first = next(order)
        b.close()  # leaves: withdraws from the trainers at once
        rest = list(order)
        assert first == mine[0] and sorted([first, *rest]) == list(range(len(index.shards)))
    finally:
        for d in sets:
            d.close()
        for p in peers:
            p.close()
        seed.close()
