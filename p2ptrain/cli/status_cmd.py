"""``p2ptrain status``: who trains in a run, how fast and how far along, read from the DHT alone.

Every training peer publishes an owner-signed progress record under ``{run_id}/progress`` (see
:mod:`p2ptrain.optim.progress`); this command joins the swarm as a client-mode node (it serves
nothing and stores nothing), reads those records from the k closest peers, validates them exactly
as the peers themselves do, and prints one row per peer, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from dht import ConfigError, DHTConfig, DHTNode, Identity

from .leaderboard import add_args as add_leaderboard_args
from .leaderboard import check_args as check_leaderboard_args
from .leaderboard import show_leaderboard
from .common import (EXIT_FAILURE, EXIT_OK, add_swarm_key_arg, bootstrap_addrs, fail, joining, make_console, run,
                     swarm_key_of, until)

if TYPE_CHECKING:
    from ..optim.progress import PeerReport


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show the peers of a training run (epoch, throughput, last seen), read from the DHT",
        description="Join the swarm as a client, read the progress records every training peer publishes "
        "and show them as a table: peer, epoch, samples toward it, samples/s, ready to average, address, "
        "when it last reported, and whether it left.",
    )
    p.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                   help="any peer of the swarm (repeatable); default: $P2PTRAIN_BOOTSTRAP, else ./bootstrap_peers.txt")
    p.add_argument("--bootstrap-file", metavar="PATH", help="file of bootstrap multiaddrs, one per line")
    p.add_argument("--run-id", help="the run to show (the peers print it when they start)")
    p.add_argument("--example", choices=["digits", "char_lm"],
                   help="derive the run id as 'p2ptrain peer --example ...' does with default options "
                   "(default when no --run-id: digits)")
    p.add_argument("--json", action="store_true", help="print the swarm (or the leaderboard) as one JSON object")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds for joining and for reading (default: %(default)s)")
    add_leaderboard_args(p)
    add_swarm_key_arg(p)
    p.set_defaults(func=main)


def default_run_id(example: str) -> str:
    """The run id ``p2ptrain peer --example EXAMPLE`` uses when none is given: the task's signature."""
    from ..tasks import get_task

    return get_task(example).signature


def main(args: argparse.Namespace) -> int:
    if args.run_id is not None and args.example is not None:
        raise ConfigError("give --run-id or --example, not both (--example only derives the run id)")
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")
    if (why := check_leaderboard_args(args)) is not None:
        raise ConfigError(why)
    swarm_key = swarm_key_of(args)
    boot = bootstrap_addrs(args.bootstrap, args.bootstrap_file)
    if not boot:
        raise ConfigError("status reads the swarm's DHT: give --bootstrap MULTIADDR of any peer (a peer prints "
                          "its address when it starts), or entries in bootstrap_peers.txt")
    run_id = args.run_id if args.run_id is not None else default_run_id(args.example or "digits")
    if not run_id or "/" in run_id or len(run_id) > 100:
        raise ConfigError(f"--run-id {run_id!r}: a run id is 1 to 100 characters without '/'")
    key = f"{run_id}/progress"
    from ..optim.progress import read_reports

    async def session(stop: asyncio.Event) -> int:
        node = DHTNode(Identity(), None, config=DHTConfig(bootstrap_timeout=args.timeout), swarm_key=swarm_key)
        try:
            with joining(boot, args.timeout):
                await node.start(boot)
            if args.leaderboard:
                try:
                    async with asyncio.timeout(args.timeout):
                        code = await until(stop, show_leaderboard(args, node, run_id))
                except TimeoutError:
                    return fail(f"reading the receipts of run {run_id!r} timed out after {args.timeout:g} s; try a "
                                "larger --timeout")
                return EXIT_FAILURE if code is None else code
            try:
                async with asyncio.timeout(args.timeout):
                    result = await until(stop, read_reports(node, key))  # the peers' own validation
            except TimeoutError:
                return fail(f"reading key {key!r} timed out after {args.timeout:g} s; the swarm may be overloaded, "
                            "try a larger --timeout")
            if result is None:  # Ctrl+C
                return EXIT_FAILURE
            reports, read = result
            return _show(args, run_id, key, reports, len(read.values), len(node.routing), time.time())
        finally:
            await node.close()

    return run(session)


def _show(args: argparse.Namespace, run_id: str, key: str, reports: list[PeerReport], entries: int, dht_peers: int,
          now: float) -> int:
    """Print ``reports`` (read at ``now``, from ``entries`` peers' entries) as a table or JSON; a one-line
    error when there is none."""
    how = "check the run id (a peer prints it when it starts; --run-id or --example must match) and that its " \
          "peers are training now (records expire some seconds after a peer stops)"
    if not entries:
        return fail(f"no progress records under key {key!r} (run {run_id!r}, {dht_peers} DHT peers asked); {how}")
    if not reports:
        return fail(f"{entries} records under key {key!r}, none a valid progress report (peers of another "
                    "p2ptrain version, or a key used for something else)")
    reports.sort(key=lambda r: (r.left, -r.epoch, str(r.peer)))
    active = [r for r in reports if not r.left]
    epoch = max((r.epoch for r in active), default=max(r.epoch for r in reports))
    at_epoch = [r for r in active if r.epoch == epoch]
    schemas = {r.schema for r in reports}
    swarm = {"epoch": epoch, "samples": sum(r.samples for r in at_epoch),
             "samples_per_second": sum(r.sps for r in at_epoch),
             "peers": len(reports), "active": len(active), "at_epoch": len(at_epoch)}
    rows = [{"peer_id": str(r.peer), "peer": r.peer.short(), "epoch": r.epoch, "samples": r.samples,
             "samples_per_second": round(r.sps, 1), "ready": r.ready, "client": r.client, "left": r.left,
             "address": None if r.addr is None else f"{r.addr[0]}:{r.addr[1]}",
             "relays": [str(a) for a in r.relays], "time": r.time,
             "last_seen_s": round(max(0.0, now - r.time), 2), "schema": r.schema} for r in reports]
    if args.json:
        try:
            print(json.dumps({"run_id": run_id, "key": key, "time": now, "swarm": swarm, "peers": rows}, indent=2))
        except BrokenPipeError:  # `| head`: the reader has what it wanted; no second error at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK

    from rich.table import Table

    console = make_console()
    title = (f"run {run_id}: {swarm['active']} active peer{'s' * (swarm['active'] != 1)}"
             f"{f' ({len(reports) - len(active)} left)' if len(active) < len(reports) else ''}, "
             f"swarm epoch {epoch}, {swarm['samples_per_second']:,.0f} samples/s")
    table = Table(title=title, title_justify="left")
    columns = ["peer", "epoch", "samples", "samples/s", "ready", "address", "last seen", "state"]
    if len(schemas) > 1:
        columns.append("model")
    for col in columns:
        table.add_column(col, justify="right" if col in ("epoch", "samples", "samples/s", "last seen") else "left",
                         no_wrap=True)
    for r, row in zip(reports, rows):
        cells = [row["peer"], str(r.epoch), f"{r.samples:,}", f"{r.sps:,.0f}", "yes" if r.ready else "no",
                 row["address"] or ("behind NAT, relayed" if r.relays else "client"), _ago(row["last_seen_s"]),
                 "left" if r.left else ("behind" if r.epoch < epoch else "training")]
        if len(schemas) > 1:
            cells.append(r.schema[:8])
        table.add_row(*cells)
    console.print(table)
    if len(schemas) > 1:
        console.print(f"{len(schemas)} different models (schemas) in this run: peers of different models never "
                      "average together")
    return EXIT_OK


def _ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
