"""Peers behind NAT as full members of a training swarm (the netns test bed, root).

Two digits swarms of ``p2ptrain peer`` processes in one run, one host each: ``--hosts`` public
peers (the baseline), then the same number of hosts of which ``--nat`` sit behind NAT routers of
their own (``Testbed(nat=...)``, ``--behind-nat``; the public ones ``--relay``). Prints, for the
NAT'd swarm, the share of the averaging work (values of the group rounds' vectors) the NAT'd peers
owned against their share of the declared bandwidth, the share of NAT'd pairs holding a direct
(hole-punched) connection at the end, and both swarms' accuracy. ``--nat-bandwidth F``: the NAT'd
peers declare ``--bandwidth F`` (the public ones 1.0), so their expected share is F*nat/(F*nat + public).

    python benchmarks/nat_swarm.py [--hosts 8] [--nat 4] [--epochs 30] [--nat-type cone|symmetric]
                                   [--nat-bandwidth 0.5] [--skip-public]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from p2ptrain.testing import Testbed, available  # noqa: E402
from p2ptrain.testing.bed_peers import train_swarm  # noqa: E402


def swarm(args: argparse.Namespace, nat: list[int]) -> dict:
    train = ["--threads", "1", "--epochs", str(args.epochs), "--wait-peers", str(args.hosts),
             "--compute-delay", str(args.compute_delay)]
    t0 = time.monotonic()
    with Testbed(args.hosts, rate=args.rate, delay=args.delay, loss=args.loss, nat=nat, nat_type=args.nat_type) as tb:
        runs = train_swarm(tb, train, timeout=args.timeout, start_timeout=300,
                           per_host={i: ["--bandwidth", str(args.nat_bandwidth)] for i in nat})
    done = [d for _, d in runs]
    accuracy = [d["metrics"]["accuracy"] for d in done]
    out = {"seconds": round(time.monotonic() - t0, 1), "accuracy_mean": round(statistics.mean(accuracy), 4),
           "accuracy_min": round(min(accuracy), 4), "epochs": [d["epoch"] for d in done],
           "rounds_in_group": [d["rounds"] - d["failed_rounds"] for d in done]}
    if nat:
        owned = sum(d["owned_values"] for d in done)
        out["nat_owned_share"] = round(sum(done[i]["owned_values"] for i in nat) / owned, 3) if owned else 0.0
        declared = args.nat_bandwidth * len(nat)
        out["nat_bandwidth_share"] = round(declared / (declared + args.hosts - len(nat)), 3)
        ids = [s["peer_id"] for s, _ in runs]
        pairs = list(itertools.combinations(nat, 2))

        def linked(i: int, j: int, kind: str) -> bool:
            return ids[j] in done[i]["links"][kind] or ids[i] in done[j]["links"][kind]

        direct = [pair for pair in pairs if linked(*pair, "direct")]
        relayed = [pair for pair in pairs if pair not in direct and linked(*pair, "relayed")]
        out.update(nat_pairs=len(pairs), nat_pairs_direct=len(direct), nat_pairs_relayed_only=len(relayed),
                   nat_pairs_direct_share=round(len(direct) / len(pairs), 3) if pairs else None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--nat", type=int, default=4, help="hosts behind NAT in the second swarm (the last ones)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--compute-delay", type=float, default=0.1, help="emulated compute per step, seconds")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--delay", default=None, help="one-way delay of every link, e.g. 10ms")
    p.add_argument("--loss", default=None)
    p.add_argument("--nat-type", default="cone", choices=("cone", "symmetric"))
    p.add_argument("--timeout", type=float, default=400.0, help="seconds a swarm may train")
    p.add_argument("--nat-bandwidth", type=float, default=1.0, help="the bandwidth the NAT'd peers declare")
    p.add_argument("--skip-public", action="store_true", help="run only the swarm with NAT'd peers")
    args = p.parse_args()
    ok, why = available()
    if not ok:
        print(f"no network namespaces here: {why}", file=sys.stderr)
        return 2
    if not 0 < args.nat < args.hosts:
        p.error("--nat must be between 1 and --hosts - 1 (host 0 is the public bootstrap)")
    public = None if args.skip_public else swarm(args, [])
    behind = swarm(args, list(range(args.hosts - args.nat, args.hosts)))
    out = {"public": public, "nat": behind}
    if public:
        out["accuracy_ratio"] = round(behind["accuracy_mean"] / public["accuracy_mean"], 4)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
