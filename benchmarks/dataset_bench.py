"""Dataset fetch from K providers, and per-epoch coverage of a dataset across a swarm.

    python benchmarks/dataset_bench.py                          # 64 MB, R = 20 MB/s, K = 1 2 4
    python benchmarks/dataset_bench.py --size-mb 16 --rate-mb 8 --providers 1 2 --peers 4

Fetch: a text dataset of ``--size-mb`` MB (random lines: nothing dedupes) is added once to a
store (1 MiB shards, 128 KiB chunks); for each K, K provider processes serve it from that store,
each capped at R = ``--rate-mb`` MB/s (``StateServer(rate=...)``, as an uplink would be), and
announce it in a fresh DHT. A fetcher process joins and fetches every shard into an empty store
(``fetch_shards``: 4 shards at a time, each from every provider, each chunk verified and written
as it lands). Printed per K: the aggregate rate (size / fetch time, the index fetch and DHT
lookups excluded), K*R, their ratio (target >= 0.8) and the chunks each provider delivered;
then the same fetch from max(K) uncapped providers: the fetcher's own ceiling on this machine.

Coverage: ``--peers`` trainers (background DHT peers in this process, each with its own store)
read ``--epochs`` epochs of a dataset one seed peer added; per epoch, how many shards were read
exactly once across the swarm, not at all, or more than once, and the spread of shards per
peer. Then the same from rendezvous hashing alone for 16 peers over 100 epochs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, loadavg, sigterm_as_exit  # noqa: E402

HERE = os.path.abspath(__file__)
MB = 1e6
SHARD = 1 << 20


def write_corpus(path: str, size_mb: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      "
    with open(path, "w") as f:
        left = int(size_mb * MB)
        while left > 0:
            line = "".join(rng.choices(alphabet, k=rng.randint(40, 200))) + "\n"
            f.write(line)
            left -= len(line)


# ---------------------------------------------------------------------------------- roles


async def provider(args: argparse.Namespace) -> None:
    from dht import DHTConfig, DHTNode, Multiaddr
    from p2ptrain.checkpoint import StateServer
    from p2ptrain.data.store import DataStore
    from p2ptrain.data.swarm import DataService

    node = DHTNode(config=DHTConfig(rpc_timeout=2.0))
    await node.start([Multiaddr.parse(a) for a in args.bootstrap or []])
    store = DataStore(args.store)
    index = store.index(bytes.fromhex(args.dataset))
    server = StateServer(node.host, rate=args.rate_mb * MB if args.rate_mb else None)
    await server.start()
    service = DataService(node, store, index, server=server)
    await service.start()
    print(json.dumps({"event": "ready", "addr": str(node.multiaddrs[0])}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent is done
    await service.close()
    await server.close()
    await node.close()


async def fetcher(args: argparse.Namespace) -> None:
    from dht import DHTConfig, DHTNode, Multiaddr
    from p2ptrain.data.store import DataStore
    from p2ptrain.data.swarm import fetch_index, fetch_shards, members

    node = DHTNode(config=DHTConfig(rpc_timeout=2.0))
    await node.start([Multiaddr.parse(a) for a in args.bootstrap])
    store = DataStore(args.store)
    did = bytes.fromhex(args.dataset)
    index = await fetch_index(node, store, did)
    for _ in range(50):  # the announcements are in before the providers say ready; lookups may lag a hop
        if len(await members(node, did, len(index.shards))) >= args.expect:
            break
        await asyncio.sleep(0.1)  # polling the DHT: there is no event to wait on across processes
    t0 = time.perf_counter()
    got = await fetch_shards(node, store, index, list(range(len(index.shards))), timeout=600)
    seconds = time.perf_counter() - t0
    ok = store.verify(did) == [] and all(store.held(index))
    print(json.dumps({"event": "fetched", "seconds": seconds, "bytes": index.size,
                      "contributors": {str(p)[-6:]: n for p, n in got.items()}, "verified": ok}), flush=True)
    await node.close()


# ---------------------------------------------------------------------------------- parent


def fetch_round(k: int, rate_mb: float, store_dir: str, did: bytes, root: str) -> dict:
    with Children(f"data-k{k}") as kids:
        addr = None
        for i in range(k):
            argv = [sys.executable, HERE, "--role", "provider", "--store", store_dir, "--dataset", did.hex(),
                    "--rate-mb", str(rate_mb)]
            if addr is not None:
                argv += ["--bootstrap", addr]
            kids.spawn(f"prov{i}", argv, stdin=True)
            _, _, ev = kids.wait_for(lambda n, e, i=i: n == f"prov{i}" and e.get("event") == "ready", 60)
            addr = addr or ev["addr"]
        fetch_dir = os.path.join(root, f"fetch{k}")
        kids.spawn("fetcher", [sys.executable, HERE, "--role", "fetcher", "--store", fetch_dir, "--bootstrap", addr,
                               "--dataset", did.hex(), "--expect", str(k)])
        _, _, ev = kids.wait_for(lambda n, e: n == "fetcher" and e.get("event") == "fetched", 600)
        shutil.rmtree(fetch_dir, ignore_errors=True)
        return ev


def swarm_coverage(peers: int, epochs: int, root: str, corpus: str) -> list[collections.Counter]:
    """Shard read counts per epoch when ``peers`` trainers read ``epochs`` epochs together."""
    import threading

    from dht import DHTConfig
    from p2ptrain.background import DHT
    from p2ptrain.data import SwarmDataset
    from p2ptrain.data.store import DataStore
    from p2ptrain.data.swarm import DataService

    fast = DHTConfig(rpc_timeout=1.0, maintenance_period=0.5)
    seed = DHT([], listen=("127.0.0.1", 0), config=fast)
    nodes, sets = [], []
    try:
        store = DataStore(os.path.join(root, "cov-seed"))
        index = store.add([corpus], "coverage", seed.node.identity, shard_bytes=64 << 10)
        seed.run(DataService(seed.node, store, index).start(), timeout=10)
        nodes = [DHT([seed.multiaddrs[0]], listen=("127.0.0.1", 0), config=fast) for _ in range(peers)]
        sets = [SwarmDataset(n, index.id, data_dir=os.path.join(root, f"cov{k}"), epochs=epochs, refresh=60)
                for k, n in enumerate(nodes)]
        threads = [threading.Thread(target=lambda d=d: sum(1 for _ in d)) for d in sets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        out = []
        for e in range(epochs):
            c = collections.Counter({i: 0 for i in range(len(index.shards))})
            c.update(i for d in sets for i in d.read.get(e, []))
            out.append(c)
        return out
    finally:
        for d in sets:
            d.close()
        for n in nodes:
            n.close()
        seed.close()


def hash_coverage(peers: int, epochs: int, shards: int) -> tuple[float, float]:
    """(max/mean, min/mean) shards per peer per epoch from rendezvous hashing alone."""
    from dht import Identity
    from p2ptrain.data.assign import owner

    ids = [Identity().peer_id for _ in range(peers)]
    hi, lo = [], []
    for e in range(epochs):
        per = collections.Counter(owner(b"x" * 32, e, i, ids) for i in range(shards))
        mean = shards / peers
        hi.append(max(per.values()) / mean)
        lo.append(min(per.get(p, 0) for p in ids) / mean)
    return sum(hi) / epochs, sum(lo) / epochs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=64, help="dataset size in MB (default 64)")
    ap.add_argument("--rate-mb", type=float, default=20, help="each provider's upload cap R in MB/s (default 20)")
    ap.add_argument("--providers", type=int, nargs="+", default=[1, 2, 4], help="values of K (default 1 2 4)")
    ap.add_argument("--peers", type=int, default=4, help="trainers in the coverage run (default 4)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs in the coverage run (default 3)")
    ap.add_argument("--role", choices=["parent", "provider", "fetcher"], default="parent", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", action="append", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "provider":
        asyncio.run(provider(args))
        return
    if args.role == "fetcher":
        asyncio.run(fetcher(args))
        return
    sigterm_as_exit()
    root = tempfile.mkdtemp(prefix="p2ptrain-data-bench-")
    try:
        from dht import Identity
        from p2ptrain.data.store import DataStore

        corpus = os.path.join(root, "corpus.txt")
        write_corpus(corpus, args.size_mb)
        store_dir = os.path.join(root, "seed")
        index = DataStore(store_dir).add([corpus], "bench", Identity(), shard_bytes=SHARD)
        print(f"dataset of {index.size / MB:.1f} MB in {len(index.shards)} shards; {loadavg()}", flush=True)
        print(f"\nfetch from K providers, each capped at R = {args.rate_mb:g} MB/s (target: aggregate >= 0.8 K R)")
        print(f"  {'K':>2}  {'seconds':>8}  {'aggregate MB/s':>14}  {'K*R':>6}  {'ratio':>5}  chunks per provider")
        for k in args.providers:
            ev = fetch_round(k, args.rate_mb, store_dir, index.id, root)
            agg = ev["bytes"] / MB / ev["seconds"]
            kr = k * args.rate_mb
            chunks = " ".join(str(n) for n in sorted(ev["contributors"].values(), reverse=True))
            flag = "" if ev["verified"] else "  (NOT verified)"
            print(f"  {k:>2}  {ev['seconds']:8.2f}  {agg:14.1f}  {kr:6.0f}  {agg / kr:5.2f}  {chunks}{flag}",
                  flush=True)
        k = max(args.providers)
        ev = fetch_round(k, 0, store_dir, index.id, root)  # rate 0: uncapped
        print(f"  context: the fetcher's own ceiling here, K = {k} without caps: "
              f"{ev['bytes'] / MB / ev['seconds']:.0f} MB/s (K*R above it cannot be reached)", flush=True)
        small = os.path.join(root, "small.txt")
        write_corpus(small, 2, seed=1)
        print(f"\ncoverage: {args.peers} trainers read {args.epochs} epochs of a 2 MB dataset (64 KiB shards)")
        for e, c in enumerate(swarm_coverage(args.peers, args.epochs, root, small)):
            once = sum(1 for n in c.values() if n == 1)
            print(f"  epoch {e}: {once}/{len(c)} shards read exactly once, {sum(1 for n in c.values() if n == 0)} "
                  f"not at all, {sum(1 for n in c.values() if n > 1)} more than once", flush=True)
        hi, lo = hash_coverage(16, 100, 1000)
        print(f"  rendezvous alone, 16 peers, 1000 shards, 100 epochs: shards per peer max/mean {hi:.2f}, "
              f"min/mean {lo:.2f} (every shard has exactly one reader by construction)")
        print(f"\n{loadavg()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
