"""A Sybil STORE flood against one DHT node: do honest STOREs still land, and what does the victim hold?

    python benchmarks/store_flood.py                                   # this checkout
    git worktree add /tmp/before <rev> && \\
      python benchmarks/store_flood.py --before /tmp/before            # that tree's dht/, then this one

The victim is a lone ``DHTNode`` with the default ``DHTConfig`` in a process of its own (run from
the tree named, so an older ``dht/`` can be measured against this one). The attacker
(``sybil_store_flood`` of ``p2ptrain.testing.hostile.records``) uses ``--identities`` fresh
identities, from ``--source-ip`` (127.0.0.2: another address group than the honest peer's;
127.0.0.1: the same one), each storing up to ``--records`` unique keys of ``--value-size`` bytes
until refused. Meanwhile an honest peer (127.0.0.1) STOREs one record every 20 ms, during the flood
and for ``--after`` seconds once it ended. Per tree: what the flood got stored, how long it took,
the share of honest STOREs that succeeded during and after it, and the victim's RSS (MB) before
the flood and at its largest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _procs import loadavg, rss_mb, run_main  # noqa: E402

ATTACKER_IP = "127.0.0.2"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VICTIM = r"""
import asyncio, json, sys
from dht import DHTConfig, DHTNode

async def main():
    node = DHTNode(config=DHTConfig(maintenance_period=3600.0))
    await node.start()
    print(json.dumps({"addr": str(node.multiaddrs[0])}), flush=True)
    done = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), done.set)
    await done.wait()
    print(json.dumps({"records": len(node.storage)}), flush=True)
    await node.close()

asyncio.run(main())
"""


async def _honest(addr: str, stop: asyncio.Event, out: list[tuple[float, bool]]) -> None:
    """One STORE of a fresh key every 20 ms from 127.0.0.1; records (when, stored)."""
    from dht import Host, Identity, Multiaddr
    from dht.storage import Record

    host = Host(Identity(), None)
    await host.start()
    try:
        conn = await host.connect_addr(Multiaddr.parse(addr))
        i = 0
        while not stop.is_set():
            i += 1
            record = Record(b"honest/%d" % i, None, b"\xa2ok", time.time() + 600)
            try:
                reply = await conn.call("store", [record.to_wire()], timeout=10)
                out.append((time.monotonic(), reply == [True]))
            except Exception:
                out.append((time.monotonic(), False))
            await asyncio.sleep(0.02)
    finally:
        await host.close()


async def _attack(addr: str, args: argparse.Namespace) -> dict:
    from dht import Multiaddr
    from p2ptrain.testing.hostile.records import sybil_store_flood

    stop, honest = asyncio.Event(), []
    prober = asyncio.ensure_future(_honest(addr, stop, honest))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    flood = await sybil_store_flood(Multiaddr.parse(addr), identities=args.identities, records=args.records,
                                    value_size=args.value_size, source_ip=args.source_ip)
    t1 = time.monotonic()
    await asyncio.sleep(args.after)
    stop.set()
    await prober
    during = [ok for t, ok in honest if t0 <= t <= t1]
    after = [ok for t, ok in honest if t > t1]
    return {"accepted": flood.accepted, "refused": flood.refused, "seconds": flood.seconds,
            "during": (sum(during), len(during)), "after": (sum(after), len(after))}


def run_row(label: str, tree: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    victim = subprocess.Popen([sys.executable, "-c", VICTIM], cwd=tree, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        addr = json.loads(victim.stdout.readline())["addr"]  # type: ignore[union-attr]
        rss0, peak, stop = rss_mb(victim.pid), [0.0], threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], rss_mb(victim.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        row = asyncio.run(_attack(addr, args))
        stop.set()
        sampler.join()
        victim.stdin.close()  # type: ignore[union-attr]
        row["records"] = json.loads(victim.stdout.readline())["records"]  # type: ignore[union-attr]
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    return {"tree": label, "rss0": rss0, "rss_max": max(peak[0], rss0), **row}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", metavar="DIR", help="also measure the dht/ of this tree (a git worktree), first")
    p.add_argument("--identities", type=int, default=50)
    p.add_argument("--records", type=int, default=2000, help="per identity")
    p.add_argument("--value-size", type=int, default=4096)
    p.add_argument("--source-ip", default=ATTACKER_IP, help="the attacker's address")
    p.add_argument("--after", type=float, default=3.0, help="seconds of honest STOREs once the flood ended")
    args = p.parse_args()
    print(f"# store flood: {args.identities} identities x {args.records} records of {args.value_size} B from "
          f"{args.source_ip}, honest STOREs from 127.0.0.1 every 20 ms; {loadavg()}", flush=True)
    trees = ([("before", os.path.abspath(args.before))] if args.before else []) + [("this", HERE)]
    for label, tree in trees:
        r = run_row(label, tree, args)
        (d_ok, d_n), (a_ok, a_n) = r["during"], r["after"]
        print(f"{r['tree']:>6}  flood stored {r['accepted']} records in {r['seconds']:.1f} s ({r['refused']} refused), "
              f"victim holds {r['records']}  honest STOREs ok: during {d_ok}/{d_n} ({100 * d_ok / max(1, d_n):.0f}%), "
              f"after {a_ok}/{a_n} ({100 * a_ok / max(1, a_n):.0f}%)  victim RSS {r['rss0']:.0f} -> max "
              f"{r['rss_max']:.0f} MB", flush=True)


if __name__ == "__main__":
    run_main(main)
