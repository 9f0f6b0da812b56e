"""Hole punching success rate between peers behind real NAT routers (the netns test bed, root).

One public host runs a relay; each of ``--nat`` hosts sits behind a NAT router of its own
(``Testbed(nat=...)``), listens with ``reachable=False`` and reserves a slot at the relay. Then
every pair of NAT'd peers connects once through the relay (the lower index dials the higher's
circuit address) and the pair counts as punched when the dialer ends up with a direct connection
to the other within ``--wait`` seconds. Prints the share of pairs punched and the time from the
relayed connection to the direct one; ``--nat-type symmetric`` shows what a symmetric NAT does.

    python benchmarks/holepunch.py --nat 8 [--delay 25ms] [--nat-type cone|symmetric]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from p2ptrain.testing import Testbed, available  # noqa: E402

_PEER = r"""
import asyncio, json, sys, time
from dht import Host, Identity, Multiaddr, punch_stats
from dht.relay import relayed_via

async def main(ip, relay, wait):
    host = Host(Identity(), listen=(ip, 0), reachable=False)
    await host.start()
    circuit = await host.reserve_relay(Multiaddr.parse(relay))
    print(json.dumps({"circuit": str(circuit)}), flush=True)
    loop = asyncio.get_running_loop()
    targets = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    async def one(text):
        addr = Multiaddr.parse(text)
        t0 = time.monotonic()
        try:
            await host.connect_addr(addr, timeout=10)
        except Exception as e:
            return {"error": str(e)[:200]}
        direct = asyncio.Event()
        def seen(c):
            if c.remote_peer == addr.peer_id and relayed_via(c) is None:
                direct.set()
        host.on_connect.append(seen)
        c = host.connection(addr.peer_id)
        if c is not None and relayed_via(c) is None:
            direct.set()
        try:
            await asyncio.wait_for(direct.wait(), wait)
            return {"direct": True, "seconds": time.monotonic() - t0}
        except TimeoutError:
            return {"direct": False}
    results = await asyncio.gather(*(one(t) for t in targets))
    print(json.dumps({"results": results}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # every dialer is done
    stats, deadline = punch_stats(host), time.monotonic() + 10
    while stats.attempts > stats.direct + stats.reversed + stats.failed and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the punches this peer drives finish their handshakes
    print(json.dumps(stats.as_dict()), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await host.close()

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""

_RELAY = r"""
import asyncio, sys
from dht import Host, Identity, RelayService

async def main(ip):
    host = Host(Identity(), listen=(ip, 0))
    await host.start()
    RelayService(host).start()
    print(host.listen_addrs[0], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await host.close()

asyncio.run(main(sys.argv[1]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nat", type=int, default=8, help="peers behind NAT (pairs: n*(n-1)/2)")
    ap.add_argument("--nat-type", choices=("cone", "symmetric"), default="cone")
    ap.add_argument("--delay", default=None, help="one-way delay into each host, e.g. 25ms")
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--wait", type=float, default=15.0, help="seconds a pair may take to go direct")
    opts = ap.parse_args()
    ok, why = available()
    if not ok:
        sys.exit(f"no test bed here: {why}")
    n = opts.nat
    with Testbed(n + 1, nat=range(1, n + 1), nat_type=opts.nat_type, rate=opts.rate, delay=opts.delay) as tb:
        print(tb.describe(), flush=True)
        pipe = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        relay = tb.popen(0, [sys.executable, "-c", _RELAY, tb.hosts[0].ip], **pipe)
        relay_addr = relay.stdout.readline().strip()
        peers = [tb.popen(i, [sys.executable, "-c", _PEER, tb.hosts[i].local_ip, relay_addr, str(opts.wait)], **pipe)
                 for i in range(1, n + 1)]
        circuits = [json.loads(p.stdout.readline())["circuit"] for p in peers]
        t0 = time.monotonic()
        for i, p in enumerate(peers):
            p.stdin.write(json.dumps(circuits[i + 1:]) + "\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in peers]
        elapsed = time.monotonic() - t0
        for p in peers:
            p.stdin.write("\n")
            p.stdin.flush()
        counters = [json.loads(p.stdout.readline()) for p in peers]
        for p in (*peers, relay):
            p.stdin.write("\n")
            p.stdin.flush()
        for p in (*peers, relay):
            p.wait(timeout=30)
    results = [r for rep in reports for r in rep["results"]]
    punched = [r for r in results if r.get("direct")]
    errors = [r["error"] for r in results if "error" in r]
    totals = {k: sum(c[k] for c in counters) for k in counters[0]}
    times = sorted(r["seconds"] for r in punched)
    print(f"{opts.nat_type} NAT, {n} NAT'd peers, {len(results)} pairs: {len(punched)} punched "
          f"({100 * len(punched) / max(1, len(results)):.1f}%), {len(errors)} not even relayed; "
          f"all pairs done in {elapsed:.1f} s")
    if times:
        print(f"relayed -> direct: median {statistics.median(times) * 1e3:.0f} ms, max {times[-1] * 1e3:.0f} ms")
    print("hole punch counters summed over peers:", totals)
    for e in errors[:3]:
        print("  error:", e)


if __name__ == "__main__":
    main()
