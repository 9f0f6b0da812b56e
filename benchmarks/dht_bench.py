#!/usr/bin/env python3
"""p2ptrain DHT benchmark: swarm start, get latency/hops, survival of a 30% crash, transport speed.

    python benchmarks/dht_bench.py --nodes 64 256 [--procs P] [--gets 1000] [--json out.json]
                                   [--hivemind-python /tmp/hmvenv/bin/python] [--load P]

For each N: N DHTNodes spread over P child processes (p2ptrain/testing/dht_swarm.py; default min(8, N/8)),
each joining through 2 of process 0's nodes (rotating). Reported:
  * start time from launch until every node has bootstrapped, with and without the worker
    interpreters' start-up (which is also measured on its own: bare ``python -c pass``, and
    launch -> ready including imports);
  * store of --keys keys, each from a random node (stores run concurrently across processes);
  * gets from random nodes for random keys, ONE GET IN FLIGHT IN THE WHOLE SWARM (each process
    runs its share sequentially, processes one after another), so latency has no self-contention:
    p50/p99 ms, hops mean/max (LookupResult.hops; 0 = found locally) against the Kademlia bound
    ceil(log2 N / log2 20) + 2, success rate; with latest=False (the default get) and with latest=True
    (what hivemind's baseline measures), each process running its share of both back to back, and
    the ratio of their p99s; --load P runs P busy-looping processes alongside (a loaded box);
  * SIGKILL of ceil(30% of the processes) (process 0, the bootstrap, among them), a wait of one
    republish period (the benchmark's config sets a short one and prints it), then the same gets
    (both kinds) from surviving nodes only, while republish rounds run.
Then the transport: one encrypted p2ptrain stream (dht.transport.Host + open_stream) against raw
asyncio TCP, both sender and receiver in separate processes, uvloop when available, and the ratio.
hivemind's DHT (benchmarks/_hivemind_dht.py) runs with the same N when importable.
--cpu-per-read N (alone): CPU per read of each kind (plain, latest over the read quorum and over
the k closest, from known holders), with N nodes in this process, and the ratio to a plain get.
Every child process is killed on exit, Ctrl+C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2ptrain.testing.dht_swarm import SwarmProcess  # noqa: E402

CONFIG = {"republish_interval": 5.0, "maintenance_period": 1.0}
TPUT_PROTOCOL = "bench/bytes"
_children: list[asyncio.subprocess.Process] = []  # every non-swarm child, killed in main()'s finally


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


# ------------------------------------------------------------------------------------- DHT swarm


async def interpreter_start_s(runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await p.wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def run_gets(procs: list[SwarmProcess], alive: dict[int, list[int]], keys: dict[str, Any], n: int,
                   rng: random.Random, n_latest: int = 0) -> tuple[dict, dict]:
    """``n`` plain gets and ``n_latest`` with latest=True, each from a random live node (``alive``:
    process -> its live nodes). Each process runs its share of both kinds back to back, so that
    the two kinds see the same load and republish rounds."""
    nodes = [(i, j) for i, js in alive.items() for j in js]
    plans: list[dict[int, list]] = [{i: [] for i in alive}, {i: [] for i in alive}]
    for latest, count in enumerate((n, n_latest)):
        for _ in range(count):
            i, j = rng.choice(nodes)
            plans[latest][i].append([j, rng.choice(list(keys))])
    results: list[list] = [[], []]
    for i in alive:  # one process at a time: one get in flight in the whole swarm
        for latest, plan in enumerate(plans):
            if plan[i]:
                reply = await procs[i].request("get_many", gets=plan[i], latest=bool(latest), timeout=300)
                results[latest] += [(key, r) for (_, key), r in zip(plan[i], reply["results"])]
    plain, fresh = (_get_stats(rs, keys) for rs in results)
    return plain, fresh


def _get_stats(results: list, keys: dict[str, Any]) -> dict:
    ok = [r for key, r in results if r["value"] == keys[key]]
    ms = [r["ms"] for _, r in results]
    hops = [r["hops"] for r in ok]
    return {"gets": len(results), "success": len(ok) / max(1, len(results)),
            "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms, default=float("nan")),
            "hops_mean": statistics.fmean(hops) if hops else float("nan"), "hops_max": max(hops, default=0),
            "errors": sorted({r.get("error", "wrong or missing value") for key, r in results
                             if r["value"] != keys[key]})[:3]}


async def bench_dht(n_nodes: int, n_procs: int, n_keys: int, n_gets: int, seed: int) -> dict:
    rng = random.Random(seed)
    sizes = [n_nodes // n_procs + (1 if i < n_nodes % n_procs else 0) for i in range(n_procs)]
    procs: list[SwarmProcess] = []
    out: dict[str, Any] = {"impl": "p2ptrain", "nodes": n_nodes, "procs": n_procs, "config": CONFIG}
    try:
        t0 = time.perf_counter()
        spawned = await asyncio.gather(*(SwarmProcess.spawn() for _ in range(n_procs)), return_exceptions=True)
        procs = [p for p in spawned if isinstance(p, SwarmProcess)]
        if len(procs) < n_procs:
            raise next(p for p in spawned if isinstance(p, BaseException))
        t_ready = time.perf_counter()
        first = await procs[0].request("start", n=sizes[0], config=CONFIG)
        # Each joining node dials 2 of process 0's nodes (rotating): one bootstrap node for hundreds
        # of simultaneous joins times out on a 2-core machine (see the report).
        boot = first["addrs"]
        await asyncio.gather(*(p.request("start", n=s, bootstrap=boot, bootstrap_per_node=2, config=CONFIG,
                                         timeout=120)
                               for p, s in zip(procs[1:], sizes[1:])))
        t_up = time.perf_counter()
        out["start_s"] = t_up - t0
        out["start_excl_interp_s"] = t_up - t_ready
        out["proc_ready_s_max"] = max(p.spawn_s for p in procs)
        log(f"N={n_nodes}: {n_procs} processes ready in {t_ready - t0:.2f} s, all nodes up after {t_up - t0:.2f} s")

        keys = {f"bench-key-{i}": {"i": i, "pad": "v" * 32} for i in range(n_keys)}
        t1 = time.perf_counter()
        stores = [(rng.randrange(n_procs), k, v) for k, v in keys.items()]
        accepted = await asyncio.gather(*(procs[i].request("store", node=rng.randrange(sizes[i]), key=k, value=v,
                                                           ttl=3600, timeout=120) for i, k, v in stores))
        out["store"] = {"s": time.perf_counter() - t1,
                        "accepted_mean": statistics.fmean(a["accepted"] for a in accepted)}
        out["hops_target"] = math.ceil(math.log2(n_nodes) / math.log2(20)) + 2
        alive = {i: list(range(s)) for i, s in enumerate(sizes)}
        out["get"], out["get_latest"] = await run_gets(procs, alive, keys, n_gets, rng, n_gets)
        log(f"N={n_nodes}: gets {out['get']}")

        # Remove exactly ceil(30%) of the nodes: SIGKILL whole processes (process 0, the bootstrap,
        # first) while they fit, then stop the remainder inside one surviving process.
        target = math.ceil(0.3 * n_nodes)
        order = [0] + rng.sample(range(1, n_procs), n_procs - 1)
        victims, killed = [], 0
        for i in order[:-1]:
            if killed + sizes[i] <= target:
                victims.append(i)
                killed += sizes[i]
        for i in victims:
            procs[i].kill()
            del alive[i]
        await asyncio.gather(*(procs[i].proc.wait() for i in victims))
        if killed < target:
            i = next(i for i in order if i in alive and len(alive[i]) > target - killed)
            stop, alive[i] = alive[i][: target - killed], alive[i][target - killed :]
            await procs[i].request("stop", nodes=stop)
        wait = CONFIG["republish_interval"] + CONFIG["maintenance_period"] + 1.0
        log(f"N={n_nodes}: SIGKILLed {len(victims)} processes ({killed} nodes), stopped {target - killed} more; "
            f"waiting {wait:.0f} s (one republish period)")
        await asyncio.sleep(wait)  # time must pass: the republish period is a timer, not an event
        after, out["after_kill_latest"] = await run_gets(procs, alive, keys, n_gets, rng, n_gets)
        after.update(killed=target, killed_frac=target / n_nodes, sigkilled_procs=len(victims), waited_s=wait)
        out["after_kill"] = after
        return out
    finally:
        for p in procs:
            p.kill()
        await asyncio.gather(*(p.close(timeout=2) for p in procs), return_exceptions=True)


# ------------------------------------------------------------------------------------ throughput


def _use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


async def _tput_recv(mode: str) -> None:
    """Child: accept one sender, count its bytes until EOF, answer b"k". Prints where to dial."""
    done = asyncio.get_running_loop().create_future()
    if mode == "raw":
        class Sink(asyncio.BufferedProtocol):
            buf = bytearray(1 << 20)

            def connection_made(self, transport: Any) -> None:
                self.t = transport

            def get_buffer(self, sizehint: int) -> memoryview:
                return memoryview(self.buf)

            def buffer_updated(self, nbytes: int) -> None:
                pass

            def eof_received(self) -> bool:
                self.t.write(b"k")
                self.t.close()  # flushes the answer first
                return True

            def connection_lost(self, exc: Exception | None) -> None:
                if not done.done():
                    done.set_result(None)

        server = await asyncio.get_running_loop().create_server(Sink, "127.0.0.1", 0)
        print(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await done
        return
    from dht import Host, Identity

    async def handler(stream: Any) -> None:
        n = 0
        while (chunk := await stream.read()) is not None:
            n += len(chunk)
        await stream.write(n.to_bytes(8, "big"))
        done.set_result(None)

    host = Host(Identity(), ("127.0.0.1", 0))
    host.on_stream(TPUT_PROTOCOL, handler)
    await host.start()
    print(host.listen_addrs[0], flush=True)
    await done
    await asyncio.sleep(0.2)
    await host.close()


async def _tput_send(mode: str, addr: str, total: int) -> None:
    """Child: send ``total`` bytes in 1 MiB writes, wait for the receiver's answer, print GB/s."""
    buf = memoryview(bytearray(os.urandom(1 << 20)))
    if mode == "raw":
        host, port = addr.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        t0 = time.perf_counter()
        for _ in range(total >> 20):
            writer.write(buf)
            await writer.drain()
        writer.write_eof()
        assert await reader.read(1) == b"k"
        dt = time.perf_counter() - t0
        writer.close()
    else:
        from dht import Host, Identity, Multiaddr

        h = Host(Identity(), None)
        await h.start()
        conn = await h.connect_addr(Multiaddr.parse(addr))
        stream = await conn.open_stream(TPUT_PROTOCOL)
        t0 = time.perf_counter()
        for _ in range(total >> 20):
            await stream.write(buf)
        stream.write_eof()
        got = await stream.read_all(8)
        dt = time.perf_counter() - t0
        assert int.from_bytes(got, "big") == total, got
        await h.close()
    print(json.dumps({"mode": mode, "bytes": total, "s": dt, "gbps": total / dt / 1e9}), flush=True)


async def _child(*args: str, **kw: Any) -> asyncio.subprocess.Process:
    p = await asyncio.create_subprocess_exec(*args, **kw)
    _children.append(p)
    return p


async def bench_throughput(mode: str, total: int) -> dict:
    me = [sys.executable, str(Path(__file__).resolve())]
    recv = await _child(*me, "--_tput-recv", mode, stdout=asyncio.subprocess.PIPE)
    try:
        addr = (await asyncio.wait_for(recv.stdout.readline(), 30)).decode().strip()  # type: ignore[union-attr]
        send = await _child(*me, "--_tput-send", mode, addr, "--_tput-bytes", str(total),
                            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(send.communicate(), 300)
        await asyncio.wait_for(recv.wait(), 10)
        return json.loads(out.decode().strip().splitlines()[-1])
    finally:
        for p in _children:
            if p.returncode is None:
                p.kill()


# ------------------------------------------------------------------------------------- hivemind


async def cpu_load(n: int) -> list[asyncio.subprocess.Process]:
    """``n`` busy-looping child processes: the "loaded box" of the tail-latency figures."""
    return [await _child(sys.executable, "-c", "while True: pass") for _ in range(n)]


def stop_load(load: list[asyncio.subprocess.Process]) -> None:
    for p in load:
        if p.returncode is None:
            p.kill()


async def bench_hivemind(python: str, n_nodes: int, n_gets: int, timeout: float) -> dict | str:
    script = ROOT / "benchmarks" / "_hivemind_dht.py"
    check = await _child(python, "-c", "import hivemind", stdout=asyncio.subprocess.DEVNULL,
                         stderr=asyncio.subprocess.DEVNULL)
    if await check.wait() != 0:
        return "not installed (pip install -e .[bench])"
    if not script.exists():
        return f"not run ({script.name} missing)"
    # Its own session, so that its DHT processes and p2pd daemons die with it on cleanup.
    p = await _child(python, str(script), "--nodes", str(n_nodes), "--gets", str(n_gets), "--json",
                     "--timeout", str(timeout), stdout=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(p.communicate(), timeout * 3 + 120)
    except TimeoutError:
        return "timed out"
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else f"failed (exit code {p.returncode})"


def _kill_children() -> None:
    for p in _children:
        if p.returncode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
            except (ProcessLookupError, PermissionError):
                pass


# ------------------------------------------------------------------------------------- CPU per read


async def cpu_per_read(n_nodes: int, n_gets: int, seed: int) -> dict[str, float]:
    """Milliseconds of CPU per read with every node in this process (the asker's CPU and its
    servers' together): plain gets, latest ones over the read quorum (the default) and over the k
    closest (the baseline), and reads from k known holders of a key (as progress and board poll).
    Every connection is opened first; each kind runs twice and the second pass counts."""
    from dht import DHTConfig, DHTNode

    rng, config = random.Random(seed), DHTConfig()
    nodes: list[DHTNode] = []
    try:
        for _ in range(n_nodes):
            nodes.append(DHTNode(config=config))
            await nodes[-1].start(nodes[0].multiaddrs if len(nodes) > 1 else [])
        keys = [f"cpu/{i}" for i in range(20)]
        for i, key in enumerate(keys):
            await rng.choice(nodes).store(key, i, time.time() + 600)
        holders = {key: nodes[0].nearest_known(key) for key in keys}
        for a in nodes:  # every connection open first: a read's cost, not a handshake's
            await asyncio.gather(*(a.host.call(b.peer_id, (b.multiaddrs[0].host, b.multiaddrs[0].port), "ping")
                                   for b in nodes if b is not a))
        kinds = {"plain get": lambda nd, key: nd.lookup_value(key),
                 "latest get, read quorum": lambda nd, key: nd.lookup_value(key, latest=True),
                 "latest get, k closest": lambda nd, key: nd.lookup_value(key, latest=True),
                 "read from k known holders": lambda nd, key: nd.get_owned(key, "-", holders=holders[key])}
        out: dict[str, float] = {}
        for _ in range(2):
            for kind, read in kinds.items():
                config.read_quorum = config.k if kind.endswith("k closest") else None
                t0 = time.process_time()
                for _ in range(n_gets):
                    await read(rng.choice(nodes), rng.choice(keys))
                out[kind] = (time.process_time() - t0) * 1e3 / n_gets
        config.read_quorum = None
        return out
    finally:
        await asyncio.gather(*(nd.close() for nd in nodes), return_exceptions=True)


# ------------------------------------------------------------------------------------- reporting


def report(runs: list[dict], tput: dict, hm: dict[int, Any]) -> None:
    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    rows = []
    for r in runs:
        n, g, gl, a, ak = r["nodes"], r["get"], r["get_latest"], r["after_kill"], r["after_kill_latest"]
        rows += [
            (f"N={n} ({r['procs']} procs)", "start incl. / excl. interpreters (s)",
             f"{f(r['start_s'], '.2f')} / {f(r['start_excl_interp_s'], '.2f')}", "< 5 s (N=64)"),
            ("", "worker launch->ready (s), bare interpreter (s)",
             f"{f(r['proc_ready_s_max'], '.2f')}, {f(r['interp_s'], '.3f')}", ""),
            ("", "store 200 keys (s), replicas accepted (mean)",
             f"{f(r['store']['s'], '.2f')}, {f(r['store']['accepted_mean'])}", ""),
            ("", "get p50 / p99 ms", f"{f(g['p50_ms'], '.2f')} / {f(g['p99_ms'], '.2f')}", "p99 < 25 ms (N=64)"),
            ("", "hops mean / max (target)", f"{f(g['hops_mean'], '.2f')} / {g['hops_max']} ({r['hops_target']})",
             f"<= {r['hops_target']}"),
            ("", "get success", f"{g['success']:.2%}", "100%"),
            ("", "get latest=True p50 / p99 ms, success",
             f"{f(gl['p50_ms'], '.2f')} / {f(gl['p99_ms'], '.2f')}, {gl['success']:.2%}", ""),
            ("", f"p99 latest=True / plain ({r['load_procs']} busy processes alongside)",
             f"{gl['p99_ms'] / g['p99_ms']:.1f}x", "<= 3x"),
            ("", f"after SIGKILL {a['killed']} nodes ({a['killed_frac']:.0%}), {a['waited_s']:.0f} s: success",
             f"{a['success']:.2%}", ">= 99.9%"),
            ("", "after kill: get p50 / p99 ms, hops mean/max",
             f"{f(a['p50_ms'], '.2f')} / {f(a['p99_ms'], '.2f')}, {f(a['hops_mean'], '.2f')}/{a['hops_max']}", ""),
            ("", "after kill: latest=True p50 / p99 ms, success; p99 latest / plain",
             f"{f(ak['p50_ms'], '.2f')} / {f(ak['p99_ms'], '.2f')}, {ak['success']:.2%}; "
             f"{ak['p99_ms'] / a['p99_ms']:.1f}x", "<= 3x"),
        ]
        h = hm.get(n)
        if isinstance(h, dict) and h.get("start_s"):
            hk = h.get("after_kill") or {}
            rows += [("", "hivemind start (s) / ratio hivemind÷p2ptrain",
                      f"{f(h['start_s'], '.2f')} / {h['start_s'] / r['start_s']:.1f}x", ""),
                     ("", "hivemind get p50 / p99 ms (latest=True) / ratio vs ours latest=True",
                      f"{f(h.get('get_p50_ms'), '.2f')} / {f(h.get('get_p99_ms'), '.2f')} / "
                      f"{h['get_p50_ms'] / gl['p50_ms']:.1f}x, {h['get_p99_ms'] / gl['p99_ms']:.1f}x", ""),
                     ("", "hivemind success / after kill", f"{f(h.get('get_success'), '.2%')} / "
                      f"{f(hk.get('get_success'), '.2%')}", "")]
        elif h is not None:
            rows.append(("", "hivemind", str(h.get("error") if isinstance(h, dict) else h), ""))
    if tput:
        raw, enc = tput.get("raw"), tput.get("enc")
        if raw and enc:
            n = len(raw["trials"])
            rows += [("transport", f"raw asyncio TCP, 1 stream, 2 processes (GB/s, median of {n})",
                      f"{raw['gbps']:.2f}", ""),
                     ("", f"encrypted p2ptrain stream (GB/s, median of {n})", f"{enc['gbps']:.2f}", ""),
                     ("", "ratio encrypted / raw", f"{enc['gbps'] / raw['gbps']:.0%}", ">= 50%")]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="p2ptrain DHT benchmark")
        for col in ("swarm", "metric", "value", "target"):
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        Console(width=140).print(table)
    except ImportError:
        for row in rows:
            print(" | ".join(row))


# ------------------------------------------------------------------------------------------ main


async def amain(args: argparse.Namespace) -> dict:
    if args.cpu_per_read:
        cpu = await cpu_per_read(args.cpu_per_read, args.gets, args.seed)
        for kind, ms in cpu.items():
            print(f"{kind:<32} {ms:6.2f} ms CPU per read, {ms / cpu['plain get']:5.1f}x a plain get's")
        return {"cpu_per_read_ms": cpu}
    runs, hm, tput = [], {}, {}
    interp = await interpreter_start_s()
    load = await cpu_load(args.load)
    for n in args.nodes:
        procs = args.procs or max(1, min(8, n // 8))
        r = await bench_dht(n, procs, args.keys, args.gets, args.seed)
        r["interp_s"], r["load_procs"] = interp, args.load
        runs.append(r)
    stop_load(load)
    if not args.no_throughput:
        # Alternate raw and encrypted runs and keep medians: the machine is shared and noisy, and
        # a ratio is only meaningful between runs that saw the same conditions.
        trials: dict[str, list[float]] = {"raw": [], "enc": []}
        for _ in range(args.tput_trials):
            for mode in ("raw", "enc"):
                trials[mode].append((await bench_throughput(mode, args.tput_mib << 20))["gbps"])
                log(f"throughput {mode}: {trials[mode][-1]:.2f} GB/s")
        for mode, values in trials.items():
            tput[mode] = {"gbps": statistics.median(values), "trials": values}
    if not args.no_hivemind:
        load = await cpu_load(args.load)
        for n in args.nodes:
            log(f"hivemind N={n} ...")
            hm[n] = await bench_hivemind(args.hivemind_python, n, args.gets, args.hivemind_timeout)
            if isinstance(hm[n], str):
                log(f"hivemind: {hm[n]}")
                print(f"hivemind: {hm[n]}")
                if hm[n].startswith("not installed"):
                    break
        stop_load(load)
    report(runs, tput, hm)
    return {"runs": runs, "throughput": tput, "hivemind": {str(k): v for k, v in hm.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--procs", type=int, default=None, help="worker processes (default min(8, N/8))")
    ap.add_argument("--gets", type=int, default=1000)
    ap.add_argument("--keys", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--republish", type=float, default=CONFIG["republish_interval"],
                    help="DHTConfig.republish_interval for the swarm, s (default 5)")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--load", type=int, default=0, metavar="P",
                    help="busy-looping processes run alongside the DHT runs and hivemind's (default 0)")
    ap.add_argument("--tput-mib", type=int, default=1024, help="MiB per throughput run (default 1024)")
    ap.add_argument("--tput-trials", type=int, default=5, help="alternating raw/encrypted runs (default 5)")
    ap.add_argument("--cpu-per-read", type=int, default=0, metavar="N",
                    help="only measure CPU per read, --gets of each kind, with N nodes in this process")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--no-hivemind", action="store_true")
    ap.add_argument("--hivemind-python", default=sys.executable, help="interpreter with hivemind installed")
    ap.add_argument("--hivemind-timeout", type=float, default=240.0, help="start limit for hivemind (s)")
    ap.add_argument("--_tput-recv", dest="tput_recv", help=argparse.SUPPRESS)
    ap.add_argument("--_tput-send", dest="tput_send", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_tput-bytes", dest="tput_bytes", type=int, default=1 << 30, help=argparse.SUPPRESS)
    args = ap.parse_args()
    CONFIG["republish_interval"] = args.republish
    _use_uvloop()
    if args.tput_recv:
        return asyncio.run(_tput_recv(args.tput_recv))
    if args.tput_send:
        return asyncio.run(_tput_send(args.tput_send[0], args.tput_send[1], args.tput_bytes))
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl+C

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = asyncio.run(amain(args))
    except KeyboardInterrupt:
        log("interrupted; children killed")
        sys.exit(130)
    finally:
        _kill_children()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
