#!/usr/bin/env python3
"""Thousands of DHT nodes in one process (``dht.sim``): lookup hops and get success under churn.

    python benchmarks/dht_sim.py --nodes 256 1024 4096 [--keys 500] [--gets 2000] [--churn 0.3]
                                 [--joins 0.1] [--loss 0.01] [--seed 0] [--latest-gets 0] [--json out.json]

For each N, on a virtual clock with the real routing table, lookup and record store: N nodes join
one every 50 ms (bootstrap ping, lookup of self, bucket refresh), --keys values are stored by random
nodes at their k closest, then --gets gets from random nodes (before churn). Then --churn of the
nodes are killed at once and --joins (a fraction of N) new ones join; the same gets run at once
(routing tables still full of the dead) and again after 2.5 republish intervals (replicas restored).
Per phase: success, hops p50/p99/max (LookupResult.hops: the depth of the first holder, 0 = found
locally) against the bound ceil(log2 N / log2 k) + 2, virtual get latency p50/p99, and CPU seconds;
after the join, the CPU cost of ``RoutingTable.closest`` on the nodes' tables against a scan of the
whole table (what it did before), both in this run. --latest-gets N: before and after churn, also N
latest=True gets over the key's k closest alpha-paced and wide (``Lookup.wide``), the baselines, and
wide over the read quorum (``DHTConfig.read_window``, the default), alternating twice.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dht.sim import GetStats, NetConfig, Simulation, hop_bound  # noqa: E402


def closest_cost(sim: Simulation, calls: int = 20000) -> tuple[float, float]:
    """CPU microseconds per ``RoutingTable.closest(target, k, exclude=one peer)`` on the simulated nodes'
    tables (random nodes and targets, as a find_value reply), and per the whole-table scan it
    replaced (``heapq.nsmallest`` over every contact), in the same run."""
    rng, k = random.Random(1), sim.config.k
    cases = [(n.routing, rng.getrandbits(256), {rng.choice(sim.nodes).peer_id})
             for n in (rng.choice(sim.nodes) for _ in range(calls))]

    def scan(table, target, exclude):
        return heapq.nsmallest(k, (c for c in table if c.peer_id not in exclude), key=lambda c: c.node_id ^ target)

    times = []
    for fn in (lambda t, x, e: t.closest(x, k, exclude=e), scan):
        t0 = time.process_time()
        for table, target, exclude in cases:
            fn(table, target, exclude)
        times.append(1e6 * (time.process_time() - t0) / calls)
    assert all(t.closest(x, k, exclude=e) == scan(t, x, e) for t, x, e in cases[:200])
    return times[0], times[1]


def phase(name: str, stats: GetStats, bound: int, cpu: float) -> dict:
    row = {"phase": name, "gets": stats.asked, "success": stats.success,
           "hops_p50": stats.hop_percentile(0.5), "hops_p99": stats.hop_percentile(0.99),
           "hops_max": max(stats.hops, default=0), "bound": bound,
           "latency_p50_ms": 1000 * stats.latency_percentile(0.5),
           "latency_p99_ms": 1000 * stats.latency_percentile(0.99), "cpu_s": cpu}
    print(f"  {name:<14} success {100 * row['success']:.2f}% of {row['gets']}, hops p50/p99/max "
          f"{row['hops_p50']}/{row['hops_p99']}/{row['hops_max']} (bound {bound}), latency p50/p99 "
          f"{row['latency_p50_ms']:.0f}/{row['latency_p99_ms']:.0f} ms, {cpu:.1f} s CPU", flush=True)
    return row


def latest_rows(sim: Simulation, items: list, name: str, gets: int) -> list[dict]:
    """``gets`` latest=True gets over the key's k closest alpha-paced and wide (``Lookup.wide``), then
    wide over its read quorum (``DHTConfig.read_window``, the default), twice, on the same network."""
    rows, quorum = [], sim.config.read_quorum
    for wide, window in [(False, "k closest"), (True, "k closest"), (True, "quorum")] * 2:
        sim.wide_latest = wide
        sim.config.read_quorum = sim.config.k if window == "k closest" else quorum
        stats = sim.get_many(items, gets, latest=True)
        rows.append({"phase": name, "wide": wide, "window": sim.config.read_window, "success": stats.success,
                     "queried_per_get": stats.queried / gets, "latency_p50_ms": 1000 * stats.latency_percentile(0.5),
                     "latency_p99_ms": 1000 * stats.latency_percentile(0.99)})
        print(f"  {name:<14} latest=True {'wide' if wide else 'alpha-paced'} over the {window}: success "
              f"{100 * stats.success:.2f}% of {gets}, latency p50/p99 {rows[-1]['latency_p50_ms']:.0f}/"
              f"{rows[-1]['latency_p99_ms']:.0f} ms, {rows[-1]['queried_per_get']:.1f} contacts asked per get",
              flush=True)
    sim.wide_latest, sim.config.read_quorum = True, quorum
    return rows


def run(n: int, args: argparse.Namespace) -> dict:
    sim = Simulation(net=NetConfig(loss=args.loss), seed=args.seed)
    k = sim.config.k
    clock = time.process_time
    t0 = clock()
    sim.grow(n)
    sim.run_for(sim.net.tick * 2)  # every node's first upkeep round (the refresh of far buckets)
    join_cpu = clock() - t0
    print(f"N={n}: joined in {join_cpu:.1f} s CPU ({sim.rpcs} RPCs, {sim.rpcs / n:.0f} per node, "
          f"{sim.loop.now - 1e6:.0f} s virtual)", flush=True)
    t = clock()
    fast, scan = closest_cost(sim)
    aside = clock() - t  # (not the simulation's)
    size = sum(len(node.routing) for node in sim.nodes) / n
    print(f"  RoutingTable.closest: {fast:.1f} us per call, a whole-table scan {scan:.1f} us ({scan / fast:.1f}x; "
          f"{size:.0f} contacts per table)", flush=True)
    t = clock()
    items = sim.store_many(args.keys)
    print(f"  stored {args.keys} keys in {clock() - t:.1f} s CPU", flush=True)
    rows = []
    t = clock()
    rows.append(phase("before churn", sim.get_many(items, args.gets), hop_bound(n, k), clock() - t))
    latest = latest_rows(sim, items, "before churn", args.latest_gets) if args.latest_gets else []
    sim.kill(args.churn)
    sim.grow(round(args.joins * n))
    live = len(sim.live())
    t = clock()
    rows.append(phase("after churn", sim.get_many(items, args.gets), hop_bound(live, k), clock() - t))
    latest += latest_rows(sim, items, "after churn", args.latest_gets) if args.latest_gets else []
    t = clock()
    sim.run_for(2.5 * sim.config.republish_interval)
    repair_cpu = clock() - t
    t = clock()
    rows.append(phase("after repair", sim.get_many(items, args.gets), hop_bound(live, k), clock() - t))
    total = clock() - t0 - aside
    print(f"  repair period {repair_cpu:.1f} s CPU; total {total:.1f} s CPU, {sim.rpcs} RPCs", flush=True)
    return {"nodes": n, "live_after_churn": live, "join_cpu_s": join_cpu, "total_cpu_s": total,
            "rpcs": sim.rpcs, "closest_us": fast, "scan_us": scan, "phases": rows, "latest": latest}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--keys", type=int, default=500)
    p.add_argument("--gets", type=int, default=2000)
    p.add_argument("--churn", type=float, default=0.3, help="fraction of nodes killed at once")
    p.add_argument("--joins", type=float, default=0.1, help="new nodes joining after the kill, a fraction of N")
    p.add_argument("--loss", type=float, default=0.01, help="probability that a message is lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latest-gets", type=int, default=0,
                   help="also this many latest=True gets per phase, alpha-paced and wide alternating (twice)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = [run(n, args) for n in args.nodes]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
