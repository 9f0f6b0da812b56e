"""FSDP peers in sync mode: training time of 2 peers x 2 ranks (gloo, CPU) whose ranks agree on the
step that ends each epoch (this tree) against ranks that end it each on its own view of its shard's
swarm (the baseline, patched in by ``_fsdp_rank.py``), alternating in one run.

    python benchmarks/fsdp_sync.py [--runs 3] [--epochs 30]

Each peer is a torchrun job started by hand (``torchrun ... p2ptrain peer --fsdp``), digits, target
256. A run's time is its leaders' training loop (``seconds`` of their ``done`` events: the start is
not counted); a stall is a run whose loop took over twice the median of this tree's. Prints each
run, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _procs import REPO, Children, loadavg, run_main, sigterm_as_exit


def run(unagreed: bool, args: argparse.Namespace) -> dict[str, float]:
    """One swarm of 2 FSDP peers; its slower leader's loop seconds, failed rounds and whether the shards agree."""
    rank = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(REPO, "benchmarks", "_fsdp_rank.py"), "peer", "--fsdp", "--json",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1", "--epochs", str(args.epochs),
            "--target-batch-size", "256"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "P2PT_BENCH_UNAGREED": "1" if unagreed else "0"}
    with Children("fsdp-sync") as kids:
        kids.spawn("a", [*rank, "--wait-peers", "2"], env=env)
        _, _, started = kids.wait_for(lambda n, e: e.get("event") == "started", timeout=120)
        kids.spawn("b", [*rank, "--bootstrap", started["multiaddrs"][0]], env=env)
        done = [kids.wait_for(lambda n, e: e.get("event") == "done", timeout=600)[2] for _ in range(4)]
    leaders = [e for e in done if "rank" not in e]
    digests = {(e.get("rank", 0), e["params_digest"]) for e in done}
    return {"seconds": max(e["seconds"] for e in leaders), "failed": sum(e["failed_rounds"] for e in leaders),
            "alike": len(digests) == 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each (alternating)")
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"agreed": [], "unagreed": []}
    for i in range(args.runs):
        for name in results:
            r = run(name == "unagreed", args)
            results[name].append(r)
            print(f"run {i} {name:8s} loop {r['seconds']:6.1f} s  failed rounds {r['failed']}  "
                  f"shards alike {r['alike']}  ({loadavg()})", flush=True)
    base = statistics.median(r["seconds"] for r in results["agreed"])
    for name, rs in results.items():
        med = statistics.median(r["seconds"] for r in rs)
        stalls = sum(r["seconds"] > 2 * base for r in rs)
        print(f"{name:8s} median {med:.1f} s ({med / base:.2f}x), stalled runs {stalls}/{len(rs)}, failed rounds "
              f"{sum(r['failed'] for r in rs)}, shards alike {sum(r['alike'] for r in rs)}/{len(rs)}")


if __name__ == "__main__":
    sigterm_as_exit()
    run_main(main)
