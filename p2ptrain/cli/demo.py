"""``p2ptrain demo``: a local multi-process DHT swarm that shows the foundation working.

It starts peers in several OS processes, stores records, reads every record from every process,
then SIGKILLs a share of the processes (the bootstrap peer's included: there is no master) and
reads everything again from the survivors. Until the trainer lands this is the README's main job.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..testing.dht_swarm import SwarmProcess

from .common import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, make_console, run, until


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a local multi-process DHT swarm, kill part of it, and show it keeps working",
        description="Start a local swarm of DHT peers spread over several processes on 127.0.0.1, "
        "store records, read them from every process, SIGKILL a share of the processes (the "
        "bootstrap peer's included) and read everything again.",
    )
    p.add_argument("--peers", type=int, default=32, help="DHT peers in the swarm (default: %(default)s)")
    p.add_argument("--procs", type=int, default=8, help="OS processes to spread them over (default: %(default)s)")
    p.add_argument("--records", type=int, default=50, help="records to store (default: %(default)s)")
    p.add_argument("--kill-fraction", type=float, default=0.25,
                   help="share of processes to SIGKILL, rounded to whole processes, at least one (default: "
                   "%(default)s, 2 of 8)")
    p.add_argument("--republish", type=float, default=3.0,
                   help="republish period in seconds; the demo waits one after the kill (default: %(default)s)")
    p.set_defaults(func=main)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(args: argparse.Namespace) -> int:
    from dht import ConfigError

    if args.procs < 2 or args.peers < args.procs:
        raise ConfigError("--procs must be at least 2 and --peers at least --procs")
    if not 0 < args.kill_fraction < 1:
        raise ConfigError("--kill-fraction must be between 0 and 1 (exclusive)")

    async def session(stop: asyncio.Event) -> int:
        console = make_console(stderr=True)
        procs: list[SwarmProcess] = []
        try:
            result = await until(stop, _demo(args, console, procs))
            if result is None:
                console.print("[yellow]interrupted: shutting the swarm down[/]")
                return EXIT_INTERRUPTED
            return result
        finally:
            await asyncio.gather(*(p.close(timeout=3) for p in procs), return_exceptions=True)

    return run(session)


async def _read_all(procs: list[SwarmProcess], counts: list[int], keys: dict[str, int],
                    progress: Progress, label: str) -> tuple[int, int, list[float]]:
    task = progress.add_task(label, total=len(procs) * len(keys))
    ok = 0
    latencies: list[float] = []

    async def one(proc: SwarmProcess, n: int) -> None:
        nonlocal ok
        gets = [[random.randrange(n), key] for key in keys]
        reply = await proc.request("get_many", gets=gets, timeout=120)
        for (_, key), r in zip(gets, reply["results"]):
            ok += r.get("value") == keys[key]
            latencies.append(r["ms"])
        progress.advance(task, len(gets))

    await asyncio.gather(*(one(p, n) for p, n in zip(procs, counts)))
    return ok, len(procs) * len(keys), latencies


async def _demo(args: argparse.Namespace, console: Console, procs: list[SwarmProcess]) -> int:
    config = {"republish_interval": args.republish, "maintenance_period": 0.5, "rpc_timeout": 1.0}
    counts = [args.peers // args.procs + (i < args.peers % args.procs) for i in range(args.procs)]
    table = Table(title="p2ptrain local DHT swarm", show_header=True)
    table.add_column("step")
    table.add_column("result", justify="right")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        t0 = time.perf_counter()
        spawn = progress.add_task("starting processes", total=args.procs)

        async def spawn_one() -> SwarmProcess:
            proc = await SwarmProcess.spawn()
            procs.append(proc)
            progress.advance(spawn)
            return proc

        ordered = await asyncio.gather(*(spawn_one() for _ in range(args.procs)))
        procs[:] = ordered
        boot = await procs[0].request("start", n=counts[0], config=config)
        bootstrap = boot["addrs"][:1]
        join = progress.add_task("peers joining", total=args.peers)
        progress.advance(join, counts[0])

        async def start(proc: SwarmProcess, n: int) -> None:
            await proc.request("start", n=n, bootstrap=bootstrap, config=config, timeout=120)
            progress.advance(join, n)

        await asyncio.gather(*(start(p, n) for p, n in zip(procs[1:], counts[1:])))
        table.add_row(f"{args.peers} peers in {args.procs} processes ready", f"{time.perf_counter() - t0:.1f} s")
        table.add_row("bootstrap peer", bootstrap[0])

        keys = {f"demo/record-{i}": i for i in range(args.records)}
        store = progress.add_task("storing records", total=len(keys))
        stored_on = []
        for key, value in keys.items():
            i = random.randrange(len(procs))
            reply = await procs[i].request("store", node=random.randrange(counts[i]), key=key, value=value, ttl=600)
            stored_on.append(reply["accepted"])
            progress.advance(store)
        table.add_row(f"{len(keys)} records stored, replicas each (median)", f"{statistics.median(stored_on):.0f}")

        ok, total, lat = await _read_all(procs, counts, keys, progress, "reading from every process")
        table.add_row("reads that found the right value", f"{ok}/{total}")
        table.add_row("read latency p50 / p99", f"{_percentile(lat, .5):.1f} / {_percentile(lat, .99):.1f} ms")

        n_kill = min(args.procs - 1, max(1, round(args.kill_fraction * args.procs)))  # what the table says
        victims = [0] + random.sample(range(1, args.procs), n_kill - 1)
        for i in victims:
            procs[i].kill()
        killed_peers = sum(counts[i] for i in victims)
        table.add_row("SIGKILLed processes (bootstrap's included)", f"{n_kill} of {args.procs} "
                      f"({n_kill / args.procs:.0%}), {killed_peers} peer{'s' * (killed_peers != 1)}")
        survivors = [(p, n) for i, (p, n) in enumerate(zip(procs, counts)) if i not in victims]
        wait = progress.add_task(f"waiting one republish period ({args.republish:.0f} s)", total=None)
        await asyncio.sleep(args.republish + 1.0)  # replicas are re-spread on a timer: time must pass
        progress.remove_task(wait)
        ok2, total2, lat2 = await _read_all(
            [p for p, _ in survivors], [n for _, n in survivors], keys, progress, "reading from survivors"
        )
        table.add_row("reads after the kill", f"{ok2}/{total2}")
        table.add_row("read latency after the kill p50 / p99",
                      f"{_percentile(lat2, .5):.1f} / {_percentile(lat2, .99):.1f} ms")
    console.print(table)
    success = ok == total and ok2 == total2
    console.print("[green]the swarm survived the churn: every record is still readable[/]" if success
                  else "[red]some reads failed[/]")
    return EXIT_OK if success else EXIT_FAILURE
