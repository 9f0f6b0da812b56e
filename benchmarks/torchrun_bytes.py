"""Bytes that cross the swarm per epoch, and samples/s: P peers of K ranks each (``p2ptrain peer
--nproc-per-node K``, DDP inside, or FSDP with ``--fsdp``) against P*K single-process peers training
the same run.

    python benchmarks/torchrun_bytes.py [--peers 2] [--ranks 2] [--epochs 10] [--mode sync] [--fsdp]

Both swarms train digits on this machine over loopback, one after the other, with the same total
batch per step. A K-rank peer averages once for its K ranks, so the swarm moves about 1/K of the
bytes per machine (a group of P, not P*K, members). Prints both figures and their ratios.
"""

from __future__ import annotations

import argparse
import sys
import time

from _procs import Children, loadavg, run_main, sigterm_as_exit


def swarm(peers: int, ranks: int, args: argparse.Namespace) -> dict[str, float]:
    """Train one swarm of ``peers`` peers of ``ranks`` ranks; its totals from the leaders' done events."""
    common = [sys.executable, "-m", "p2ptrain", "peer", "--json", "--listen", "/ip4/127.0.0.1/tcp/0",
              "--threads", "1", "--epochs", str(args.epochs), "--target-batch-size", str(args.target_batch_size),
              "--mode", args.mode, "--local-steps", str(args.local_steps), "--compute-delay", str(args.compute_delay),
              "--nproc-per-node", str(ranks), *(["--fsdp"] if args.fsdp and ranks > 1 else [])]
    fsdp = args.fsdp and ranks > 1  # (every rank averages its shard: all ranks' bytes count)
    with Children(f"torchrun-{ranks}") as kids:
        kids.spawn("peer0", [*common, "--wait-peers", str(peers)])
        _, _, started = kids.wait_for(lambda n, e: e.get("event") == "started", timeout=120)
        for i in range(1, peers):
            kids.spawn(f"peer{i}", [*common, "--bootstrap", started["multiaddrs"][0]])
        done: dict[str, dict] = {}
        t0 = time.monotonic()
        shards: list[dict] = []
        while len(done) < peers or len(shards) < (peers * (ranks - 1) if fsdp else 0):
            name, _, e = kids.wait_for(lambda n, e: e.get("event") == "done" and ("rank" not in e or fsdp),
                                       timeout=600)
            if "rank" in e:
                shards.append(e)
            else:
                done[name] = e
        wall = time.monotonic() - t0
    sent = sum(e["bytes_sent"] for e in (*done.values(), *shards))
    # (samples/s over each peer's training loop: a torchrun peer's slower start is not counted)
    sps = sum(e["samples"] / e["seconds"] for e in done.values())
    return {"bytes_per_epoch": sent / args.epochs, "samples_per_s": sps,
            "accuracy": min(e["metrics"]["accuracy"] for e in done.values()), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=2, help="peers of the torchrun swarm (machines)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks per peer (K)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--target-batch-size", type=int, default=512)
    ap.add_argument("--mode", choices=["sync", "diloco"], default="sync")
    ap.add_argument("--local-steps", type=int, default=20, help="diloco H")
    ap.add_argument("--compute-delay", type=float, default=0.0, help="extra seconds per step (a bigger model)")
    ap.add_argument("--fsdp", action="store_true", help="shard the model over each peer's ranks (FSDP) instead of DDP")
    args = ap.parse_args()
    sigterm_as_exit()
    inside = "FSDP" if args.fsdp else "DDP"
    print(f"{args.peers} peers x {args.ranks} {inside} ranks against {args.peers * args.ranks} single-process peers, "
          f"digits {args.mode}, {args.epochs} epochs; {loadavg()}", flush=True)
    ranked = swarm(args.peers, args.ranks, args)
    single = swarm(args.peers * args.ranks, 1, args)
    for name, r in ((f"{args.peers} x {args.ranks} ranks", ranked), (f"{args.peers * args.ranks} x 1", single)):
        print(f"{name:>14}: {r['bytes_per_epoch'] / 1e6:8.3f} MB sent per epoch (whole swarm), "
              f"{r['samples_per_s']:8.0f} samples/s, accuracy {r['accuracy']:.3f}, {r['wall_s']:.1f} s", flush=True)
    print(f"ratio (ranks / single): bytes {ranked['bytes_per_epoch'] / single['bytes_per_epoch']:.3f} "
          f"(1/K = {1 / args.ranks:.3f}), samples/s {ranked['samples_per_s'] / single['samples_per_s']:.2f}")


if __name__ == "__main__":
    run_main(main)
