"""What contribution receipts cost (issue 32), beside the round they account for, in one run.

    python benchmarks/receipts_bench.py [--n 4 16] [--numel 65536] [--rounds 20]

Baseline: an in-process all-reduce round among N members on loopback (``AllReduceService.run``,
``--numel`` float32 values, the median of ``--rounds``). Then, per member and round: building and
signing its receipt (what a peer does after each round, off the round's path: nothing waits for
it), verifying one receipt (what a reader does per receipt), and the leaderboard over ``--rounds``
rounds' receipts of every member. Prints each as seconds and as a fraction of the round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dht import Host, Identity  # noqa: E402
from p2ptrain.averaging import AllReduceService, Group, Member  # noqa: E402
from p2ptrain.contrib import build_receipt, leaderboard, parse_signed, sign  # noqa: E402


async def rounds(n: int, numel: int, count: int) -> tuple[float, list]:
    hosts = [Host(Identity(), ("127.0.0.1", 0)) for _ in range(n)]
    for h in hosts:
        await h.start()
    services = [AllReduceService(h) for h in hosts]
    for s in services:
        await s.start()
    members = tuple(Member(h.peer_id, ("127.0.0.1", h.listen_port), 1.0, 32.0) for h in hosts)
    times, results = [], []
    try:
        for i in range(count + 2):
            group = Group(os.urandom(16), members)
            flats = [torch.randn(numel) for _ in range(n)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(s.run(group, r, flats[r], 32.0) for r, s in enumerate(services)))
            if i >= 2:  # two warm-up rounds
                times.append(time.perf_counter() - t0)
    finally:
        for s in services:
            await s.close()
        for h in hosts:
            await h.close()
    return statistics.median(times), results


def timed(fn, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"{'N':>3} {'round s':>9} {'sign s':>9} {'/round':>8} {'verify s':>9} {'board s':>9} {'/round':>8} "
          f"{'body B':>7}")
    for n in args.n:
        round_s, results = asyncio.run(rounds(n, args.numel, args.rounds))
        ids = [Identity() for _ in range(n)]
        ar = dataclasses.replace(results[0], members=tuple(i.peer_id for i in ids))
        sign_s = timed(lambda: sign(build_receipt(ar, "run/sync", "e1", ids[0].peer_id, time.time()), ids[0]), 200)
        one = sign(build_receipt(ar, "run/sync", "e1", ids[0].peer_id, time.time()), ids[0])
        verify_s = timed(lambda: parse_signed(one.to_wire()), 200)
        signed = [sign(build_receipt(dataclasses.replace(ar, rank=r), "run/sync", f"e{k}", ids[r].peer_id, 0.0),
                       ids[r]) for k in range(args.rounds) for r in range(n)]
        board_s = timed(lambda: leaderboard(signed), 3)
        print(f"{n:>3} {round_s:>9.4f} {sign_s:>9.6f} {sign_s / round_s:>7.1%} {verify_s:>9.6f} {board_s:>9.4f} "
              f"{board_s / round_s / args.rounds:>7.1%} {len(one.body):>7}")
    print(f"(board: the leaderboard over {args.rounds} rounds x N receipts; its /round: per round, against one round)")


if __name__ == "__main__":
    main()
