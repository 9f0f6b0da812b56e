"""Checkpoint fetch from K providers, and checkpoint save/load against torch.save/torch.load.

    python benchmarks/ckpt_bench.py                                  # 256 MB, R = 40 MB/s, K = 1 2 4
    python benchmarks/ckpt_bench.py --size-mb 64 --rate-mb 20 --providers 1 2
    python benchmarks/ckpt_bench.py --no-fetch --repeats 9              # save/load only

Fetch: a checkpoint of ``--size-mb`` MB (random float32 tensors: nothing dedupes) is saved once
into a store; for each K, K provider processes serve it from that store, each capped by an
in-process token bucket on its chunk sends at R = ``--rate-mb`` MB/s (``StateServer(rate=...)``, as
an uplink would be), and announce themselves in a fresh DHT. A fetcher process joins, finds the
providers in the DHT and downloads the checkpoint into an empty store of its own with
``download_checkpoint`` (chunks from all providers in parallel, each verified, written to disk and
fsynced as it lands, then committed). Printed per K: the aggregate rate (size / fetch time, DHT
lookups excluded, provider probe and commit included), K*R, and their ratio (target >= 0.8), plus
the chunks each provider delivered; then, for context, the same fetch from max(K) providers
without caps (the fetcher's own ceiling on this machine: decrypt, verify, write, fsync).

Save/load, same process, same state, both from a warm page cache: ``build_snapshot`` +
``CheckpointStore.save`` (chunked, hashed, every file fsynced) against ``torch.save`` + fsync (the
baseline made as durable; pickle, used here only as the baseline), and ``CheckpointStore.load`` +
``restore`` (every chunk verified) against ``torch.load(weights_only=True)``, alternating within
each of ``--repeats`` rounds so that both see the same load on a shared machine; the best and the
median of each are printed, the ratio as the median of the per-round ratios (robust to load that
comes and goes), and how much of a store save was ``build_snapshot`` (the copy and
hashing of the state, before any file is written). ``--no-fetch`` stops there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, loadavg, sigterm_as_exit  # noqa: E402

HERE = os.path.abspath(__file__)
RUN = "ckpt-bench"
MB = 1e6


def make_state(size_mb: float, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = int(size_mb * MB) // 4
    parts = 8
    return {f"layer{i}.weight": torch.randn(n // parts + (i < n % parts), generator=g) for i in range(parts)}


# ---------------------------------------------------------------------------------- roles


async def provider(args: argparse.Namespace) -> None:
    from dht import DHTConfig, DHTNode, Multiaddr
    from p2ptrain.checkpoint import StateServer
    from p2ptrain.checkpoint.store import CheckpointStore
    from p2ptrain.checkpoint.swarm import CheckpointService, announce

    node = DHTNode(config=DHTConfig(rpc_timeout=2.0))
    await node.start([Multiaddr.parse(a) for a in args.bootstrap or []])
    store = CheckpointStore(args.store)
    server = StateServer(node.host, rate=args.rate_mb * MB if args.rate_mb else None)
    await server.start()
    async with CheckpointService(node, store, run_id=RUN, server=server):
        for info in store.list(RUN):
            await announce(node, store, info)
        print(json.dumps({"event": "ready", "addr": str(node.multiaddrs[0])}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent is done
        print(json.dumps({"event": "served", "bytes": server.bytes_sent}), flush=True)
    await server.close()
    await node.close()


async def fetcher(args: argparse.Namespace) -> None:
    from dht import DHTConfig, DHTNode, Multiaddr
    from p2ptrain.checkpoint.store import CheckpointStore
    from p2ptrain.checkpoint.swarm import download_checkpoint, find_providers

    node = DHTNode(config=DHTConfig(rpc_timeout=2.0))
    await node.start([Multiaddr.parse(a) for a in args.bootstrap])
    store = CheckpointStore(args.store)
    mid = bytes.fromhex(args.manifest)
    providers = []
    for _ in range(50):  # the announcements are in before the providers say ready; lookups may lag a hop
        providers = await find_providers(node, RUN, mid)
        if len(providers) >= args.expect:
            break
        await asyncio.sleep(0.1)  # polling the DHT: there is no event to wait on across processes
    record = providers[0].record
    t0 = time.perf_counter()
    result = await download_checkpoint(node, store, record, providers, timeout=600)
    seconds = time.perf_counter() - t0
    ok = store.verify(mid) == []
    print(json.dumps({"event": "fetched", "seconds": seconds, "bytes": record.size, "providers": len(providers),
                      "contributors": {str(p)[-6:]: n for p, n in result.contributors.items()},
                      "dropped": {str(p)[-6:]: r for p, r in result.dropped.items()}, "verified": ok}), flush=True)
    await node.close()


# ---------------------------------------------------------------------------------- parent


def save_load(size_mb: float, repeats: int, root: str) -> tuple[dict[str, list[float]], str, bytes]:
    """Seconds of each operation in each of ``repeats`` rounds (store and torch alternate within
    a round, so both see the same machine load); returns them, the last store's path (kept as
    the providers' store) and its manifest id."""
    import torch

    from dht import Identity
    from p2ptrain.checkpoint import build_snapshot, restore
    from p2ptrain.checkpoint.store import CheckpointStore

    state = make_state(size_mb)
    identity = Identity()
    times: dict[str, list[float]] = {k: [] for k in ("store_save", "snapshot", "torch_save", "store_load",
                                                     "torch_load")}
    store_dir, mid = "", b""
    for r in range(repeats):
        store_dir = os.path.join(root, f"store{r}")  # a fresh store each time: nothing dedupes
        t0 = time.perf_counter()
        manifest, buffer = build_snapshot(state)
        t1 = time.perf_counter()
        info = CheckpointStore(store_dir).save(manifest, buffer, run_id=RUN, epoch=1, identity=identity)
        times["store_save"].append(time.perf_counter() - t0)
        times["snapshot"].append(t1 - t0)
        del buffer
        mid = info.manifest_id

        path = os.path.join(root, f"state{r}.pt")
        t0 = time.perf_counter()
        torch.save(state, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        times["torch_save"].append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        loaded = restore(*CheckpointStore(store_dir).load(mid))
        times["store_load"].append(time.perf_counter() - t0)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        del loaded

        t0 = time.perf_counter()
        baseline = torch.load(path, weights_only=True)
        times["torch_load"].append(time.perf_counter() - t0)
        del baseline
        os.unlink(path)
        if r < repeats - 1:
            shutil.rmtree(store_dir)
    return times, store_dir, mid


def fetch_round(k: int, rate_mb: float | None, store_dir: str, mid: bytes, root: str) -> dict:
    with Children(f"ckpt-k{k}") as kids:
        addr = None
        for i in range(k):
            argv = [sys.executable, HERE, "--role", "provider", "--store", store_dir]
            if rate_mb is not None:
                argv += ["--rate-mb", str(rate_mb)]
            if addr is not None:
                argv += ["--bootstrap", addr]
            kids.spawn(f"prov{i}", argv, stdin=True)
            _, _, ev = kids.wait_for(lambda n, e, i=i: n == f"prov{i}" and e.get("event") == "ready", 60)
            addr = addr or ev["addr"]
        fetch_dir = os.path.join(root, f"fetch{k}")
        kids.spawn("fetcher", [sys.executable, HERE, "--role", "fetcher", "--store", fetch_dir, "--bootstrap", addr,
                               "--manifest", mid.hex(), "--expect", str(k)])
        _, _, ev = kids.wait_for(lambda n, e: n == "fetcher" and e.get("event") == "fetched", 600)
        shutil.rmtree(fetch_dir, ignore_errors=True)
        return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=256, help="checkpoint size in MB (default 256)")
    ap.add_argument("--rate-mb", type=float, default=40, help="each provider's upload cap R in MB/s (default 40)")
    ap.add_argument("--providers", type=int, nargs="+", default=[1, 2, 4], help="values of K (default 1 2 4)")
    ap.add_argument("--repeats", type=int, default=5, help="save/load rounds (default 5)")
    ap.add_argument("--no-fetch", action="store_true", help="save/load only, no fetch from providers")
    ap.add_argument("--dir", help="scratch directory (default: a temporary one, removed at the end)")
    ap.add_argument("--role", choices=["parent", "provider", "fetcher"], default="parent", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", action="append", help=argparse.SUPPRESS)
    ap.add_argument("--manifest", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "provider":
        asyncio.run(provider(args))
        return
    if args.role == "fetcher":
        asyncio.run(fetcher(args))
        return
    if args.size_mb <= 0 or args.rate_mb <= 0 or min(args.providers) < 1 or args.repeats < 1:
        ap.error("sizes, rates, provider counts and repeats must be positive")
    sigterm_as_exit()
    root = args.dir or tempfile.mkdtemp(prefix="p2ptrain-ckpt-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        print(f"checkpoint of {args.size_mb:g} MB; {loadavg()}", flush=True)
        times, store_dir, mid = save_load(args.size_mb, args.repeats, root)
        print(f"\nsave / load, MB/s over {args.repeats} rounds: best, median; ratio = store / torch, the median of "
              "the rounds' ratios (each round runs both back to back) and the ratio of the bests")
        for op in ("save", "load"):
            s, t = (sorted(args.size_mb / x for x in times[f"{k}_{op}"]) for k in ("store", "torch"))
            paired = statistics.median(b / a for a, b in zip(times[f"store_{op}"], times[f"torch_{op}"]))
            print(f"  {op:4}  store {s[-1]:6.0f} {statistics.median(s):6.0f}   "
                  f"torch.{op} {t[-1]:6.0f} {statistics.median(t):6.0f}   ratio {paired:5.2f} "
                  f"(bests {s[-1] / t[-1]:4.2f})")
        files = min(a - b for a, b in zip(times["store_save"], times["snapshot"]))
        print(f"  store save, best seconds: {min(times['store_save']):.3f} in all = build_snapshot (copy + blake3) "
              f"{min(times['snapshot']):.3f} + CheckpointStore.save (files) {files:.3f}; "
              f"torch.save {min(times['torch_save']):.3f}")
        if args.no_fetch:
            print(f"\n{loadavg()}")
            return
        print(f"\nfetch from K providers, each capped at R = {args.rate_mb:g} MB/s (target: aggregate >= 0.8 K R)")
        print(f"  {'K':>2}  {'seconds':>8}  {'aggregate MB/s':>14}  {'K*R':>6}  {'ratio':>5}  chunks per provider")
        for k in args.providers:
            ev = fetch_round(k, args.rate_mb, store_dir, mid, root)
            agg = ev["bytes"] / MB / ev["seconds"]
            kr = k * args.rate_mb
            chunks = " ".join(str(n) for n in sorted(ev["contributors"].values(), reverse=True))
            flag = ("" if ev["verified"] and not ev["dropped"]
                    else f"  (verified={ev['verified']}, dropped={ev['dropped']})")
            print(f"  {k:>2}  {ev['seconds']:8.2f}  {agg:14.1f}  {kr:6.0f}  {agg / kr:5.2f}  {chunks}{flag}",
                  flush=True)
        k = max(args.providers)
        ev = fetch_round(k, None, store_dir, mid, root)
        print(f"  context: the fetcher's own ceiling here, K = {k} without caps: "
              f"{ev['bytes'] / MB / ev['seconds']:.0f} MB/s (K*R above it cannot be reached)")
        print(f"\n{loadavg()}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
