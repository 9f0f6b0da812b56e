"""``p2ptrain status --leaderboard``: who contributed what to a run, from the receipts in the DHT.

Every training peer publishes its signed receipts of the rounds it took part in under
``{run_id}/receipts/*`` (:mod:`p2ptrain.contrib`); a member's line of a round counts when a majority
of its group signed it. One row per PeerID (and the name it announces): rounds, samples, compute
time and bytes sent (those two are the peer's own claims), first and last seen, exclusions and why;
as a table, ``--json``, ``--csv`` or ``--prometheus`` (the text format, e.g. for a textfile collector).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .common import EXIT_OK, fail, make_console

if TYPE_CHECKING:
    from dht import DHTNode

__all__ = ["add_args", "show_leaderboard"]

_CSV_FIELDS = ["peer_id", "name", "rounds", "samples", "compute_s", "bytes_sent", "first_seen", "last_seen",
               "exclusions", "exclusion_reasons", "unconfirmed"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--leaderboard", action="store_true",
                   help="show each peer's contribution to the run (rounds, samples, compute time, bytes sent, "
                   "exclusions), confirmed by the receipts its groups signed")
    p.add_argument("--csv", action="store_true", help="--leaderboard: print it as CSV")
    p.add_argument("--prometheus", action="store_true", help="--leaderboard: print it in the Prometheus text format")


def check_args(args: argparse.Namespace) -> str | None:
    """Why these output flags do not go together; None if they do."""
    chosen = [f for f in ("json", "csv", "prometheus") if getattr(args, f)]
    if len(chosen) > 1:
        return f"give one of --{' / --'.join(chosen)}"
    if (args.csv or args.prometheus) and not args.leaderboard:
        return "--csv and --prometheus are output formats of --leaderboard"
    return None


async def show_leaderboard(args: argparse.Namespace, node: DHTNode, run_id: str) -> int:
    """Read the run's receipts from ``node``'s DHT and print the leaderboard."""
    from ..contrib import leaderboard, read_receipts

    signed, names = await read_receipts(node, run_id)
    if not signed:
        return fail(f"no receipts under keys {run_id + '/receipts/*'!r} (run {run_id!r}): check the run id, and that "
                    "its peers averaged at least once (they publish their receipts every 30 s and as they leave)")
    rows = leaderboard(signed, names)
    if args.prometheus:
        from ..metrics import LeaderboardCollector

        sys.stdout.write(LeaderboardCollector(run_id, rows).render().decode())
        return EXIT_OK
    dicts = [r.to_dict() for r in rows]
    if args.json:
        print(json.dumps({"run_id": run_id, "time": time.time(), "receipts": len(signed), "peers": dicts}, indent=2))
        return EXIT_OK
    if args.csv:
        out = csv.DictWriter(sys.stdout, _CSV_FIELDS)
        out.writeheader()
        for d in dicts:
            out.writerow({**d, "exclusion_reasons": " ".join(f"{k}:{v}" for k, v in d["exclusion_reasons"].items())})
        return EXIT_OK
    from rich.table import Table

    from .status_cmd import _ago

    now = time.time()
    table = Table(title=f"run {run_id}: contributions confirmed by {len(signed)} receipts", title_justify="left")
    for col in ("peer", "name", "rounds", "samples", "compute", "sent", "first seen", "last seen", "excluded"):
        table.add_column(col, justify="left" if col in ("peer", "name", "excluded") else "right", no_wrap=True)
    for r in rows:
        why = ", ".join(f"{k} {v}" for k, v in r.reasons.most_common())
        table.add_row(r.peer.short(), r.name or "", str(r.rounds), f"{r.samples:,}", f"{r.compute_s:,.1f} s",
                      f"{r.bytes_sent / 1e6:,.1f} MB", _seen(r.first_seen, now, _ago), _seen(r.last_seen, now, _ago),
                      f"{r.exclusions} ({why})" if r.exclusions else "0")
    make_console().print(table)
    return EXIT_OK



def _seen(t: float | None, now: float, ago: Callable[[float], str]) -> str:
    return "-" if t is None else ago(max(0.0, now - t))
