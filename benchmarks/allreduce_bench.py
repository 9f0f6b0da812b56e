"""Butterfly all-reduce throughput on loopback, with baselines measured in the same run.

    python benchmarks/allreduce_bench.py --n 2 4 --numel 67108864 --codecs none fp16 int8 topk --rounds 3

For each N it spawns N worker processes that form one group directly (no DHT: the parent collects
each worker's peer id and port and hands every worker the member list on stdin), runs ``--rounds``
rounds per codec (a barrier through the parent before each round) and prints seconds per round (the
slowest member's, median over rounds) and bus bandwidth = 2 (N-1)/N * bytes / time. Baselines:
raw single-stream loopback TCP (asyncio, two processes, 1 MiB writes) and torch.distributed gloo
all_reduce at the same N and size; ratios are printed against both. ``--profile`` runs rank 0 of the
first codec under cProfile and prints the top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MiB = 1 << 20


def _loop_policy() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


# ---------------------------------------------------------------------- worker: one member


async def _worker_main(profile_path: str | None) -> None:
    import torch

    from dht.identity import Identity, PeerID
    from dht.transport import Host
    from p2ptrain.averaging.allreduce import AllReduceConfig, AllReduceService
    from p2ptrain.averaging.group import Group, Member
    from p2ptrain.compression import get_codec

    torch.set_num_threads(1)
    host = Host(Identity(), ("127.0.0.1", 0))
    await host.start()
    print(json.dumps({"peer": host.peer_id.to_base58(), "port": host.listen_port}), flush=True)
    loop = asyncio.get_running_loop()
    readline = lambda: loop.run_in_executor(None, sys.stdin.readline)  # noqa: E731
    job = json.loads(await readline())
    members = tuple(Member(PeerID.from_base58(p), ("127.0.0.1", port)) for p, port in job["members"])
    rank, numel = job["rank"], job["numel"]
    cfg = AllReduceConfig(timeout=600, join_timeout=30, stall_timeout=30, chunk_numel=job["chunk"],
                          offload_min_numel=None if job["offload"] == "off" else 1 << 18)
    svc = AllReduceService(host, cfg, accept_wait=30)
    await svc.start()
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    prof = None
    if profile_path:
        import cProfile

        prof = cProfile.Profile()
    try:
        for ci, name in enumerate(job["codecs"]):
            codec = get_codec(name)
            for r in range(job["rounds"]):
                await readline()  # barrier: "go"
                group = Group(f"{name}-{r}".encode(), members)
                if prof is not None and ci == 0:
                    prof.enable()
                res = await svc.run(group, rank, flat, 1.0, codec)
                if prof is not None and ci == 0:
                    prof.disable()
                print(json.dumps({"codec": name, "t": res.time_total, "reduce": res.time_reduce, "gather": res.time_gather,
                                  "ok": res.ok, "sent": res.bytes_sent, "failed": res.failed}), flush=True)
    finally:
        if prof is not None:
            prof.dump_stats(profile_path)
        await svc.close()
        await host.close()


# ---------------------------------------------------------------------- baselines


def _tcp_sink(port_q) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    c, _ = srv.accept()
    buf = bytearray(4 * MiB)
    while c.recv_into(buf):
        pass
    c.close()


def raw_tcp(total: int) -> float:
    """Bytes/s of one asyncio stream writing 1 MiB buffers to a reader in another process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_tcp_sink, args=(q,))
    p.start()
    port = q.get()

    async def send() -> float:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        data = memoryview(bytearray(MiB))
        t = time.perf_counter()
        for _ in range(total // MiB):
            w.write(data)
            await w.drain()
        w.close()
        await w.wait_closed()
        return time.perf_counter() - t

    _loop_policy()
    dt = asyncio.run(send())
    p.join()
    return total / dt


def _gloo_worker(rank: int, n: int, port: int, numel: int, rounds: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x = torch.randn(numel)
    times = []
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    q.put(times)


def gloo(n: int, numel: int, rounds: int) -> float:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ps = [ctx.Process(target=_gloo_worker, args=(r, n, port, numel, rounds, q)) for r in range(n)]
    for p in ps:
        p.start()
    per_rank = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return statistics.median(max(ts[i] for ts in per_rank) for i in range(rounds))


# ---------------------------------------------------------------------- parent


def ours(n: int, numel: int, codecs: list[str], rounds: int, profile: str | None, chunk: int = 1 << 20,
         offload: str = "on") -> dict[str, list[dict]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for r in range(n):
        cmd = [sys.executable, __file__, "--worker"] + (["--profile-out", profile] if profile and r == 0 else [])
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    try:
        hello = [json.loads(p.stdout.readline()) for p in procs]
        members = [[h["peer"], h["port"]] for h in hello]
        for r, p in enumerate(procs):
            p.stdin.write(json.dumps({"members": members, "rank": r, "numel": numel, "codecs": codecs,
                                      "rounds": rounds, "chunk": chunk, "offload": offload}) + "\n")
            p.stdin.flush()
        out: dict[str, list[dict]] = {c: [] for c in codecs}
        for c in codecs:
            for _ in range(rounds):
                for p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                reports = [json.loads(p.stdout.readline()) for p in procs]
                out[c].append({"t": max(x["t"] for x in reports), "ok": all(x["ok"] for x in reports),
                               "reduce": max(x["reduce"] for x in reports), "failed": [x["failed"] for x in reports]})
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[2])
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--codecs", nargs="+", default=["none", "int8"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", metavar="FILE", help="cProfile rank 0 (first codec) into FILE and print the top")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--no-tcp", action="store_true")
    ap.add_argument("--chunk", type=int, default=1 << 20, help="values per chunk")
    ap.add_argument("--offload", choices=["on", "off"], default="on", help="codec work in a worker thread")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _loop_policy()
        asyncio.run(_worker_main(args.profile_out))
        return
    nbytes = args.numel * 4
    tcp = 1.0 if args.no_tcp else raw_tcp(min(4 << 30, max(1 << 30, 4 * nbytes)))
    print(f"raw loopback TCP, one asyncio stream, 1 MiB writes: {tcp / 1e9:.2f} GB/s")
    for n in args.n:
        g = None if args.no_gloo else gloo(n, args.numel, args.rounds)
        if g is not None:
            print(f"N={n} gloo all_reduce {nbytes / MiB:.0f} MiB: {g:.3f} s/round, "
                  f"bus {2 * (n - 1) / n * nbytes / g / 1e9:.2f} GB/s")
        res = ours(n, args.numel, args.codecs, args.rounds, args.profile if n == args.n[0] else None,
                   args.chunk, args.offload)
        for c, rounds in res.items():
            t = statistics.median(r["t"] for r in rounds)
            bus = 2 * (n - 1) / n * nbytes / t
            line = (f"N={n} p2ptrain {c:5s}: {t:.3f} s/round (reduce {statistics.median(r['reduce'] for r in rounds):.3f}),"
                    f" bus {bus / 1e9:.2f} GB/s = {bus / tcp:.2f}x raw TCP")
            if g is not None:
                line += f", {g / t:.2f}x gloo speed"
            if not all(r["ok"] for r in rounds):
                line += f"  NOT OK: {rounds[-1]['failed']}"
            print(line, flush=True)
    if args.profile:
        import pstats

        print(f"\nprofile of rank 0, N={args.n[0]}, codec {args.codecs[0]}:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
