"""Train an MLP on scikit-learn's handwritten digits with a swarm of peers (offline, CPU, seconds).

    python examples/digits_mlp.py                  # the first peer: prints the address to join
    python examples/digits_mlp.py --bootstrap /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW...   # more peers

Every peer runs this same script. Alone, it trains like plain PyTorch; with others, each
``opt.step()`` adds to the swarm's batch and the swarm takes one AdamW step together every
``--target-batch-size`` samples (``--mode sync``), or every peer takes ``--local-steps`` steps of its
own and the swarm averages what changed (``--mode diloco``). The model code is untouched: only the
optimizer is wrapped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from p2ptrain import DHT, DecentralizedOptimizer
from p2ptrain.tasks import get_task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="a peer already in the swarm (repeatable); none: start a new swarm")
    p.add_argument("--mode", choices=("sync", "diloco"), default="sync")
    p.add_argument("--epochs", type=int, default=30, help="global steps the swarm takes together (default 30)")
    p.add_argument("--target-batch-size", type=int, default=512, help="swarm samples per global step (sync)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per local step")
    p.add_argument("--local-steps", type=int, default=20, help="local steps between averaging rounds (diloco)")
    p.add_argument("--compression", default=None,
                   help="none, fp16, bf16, int8, int8-outlier or topk (default: none for sync, int8 for diloco)")
    p.add_argument("--lr", type=float, default=None, help="inner learning rate (default: the task's)")
    p.add_argument("--seed", type=int, default=0, help="model init seed: the same on every peer")
    p.add_argument("--data-seed", type=int, default=None, help="data order (default: different on every peer)")
    p.add_argument("--wait-peers", type=int, default=0, metavar="N",
                   help="wait (up to 60 s) until N peers are in the swarm before training")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu (default), cuda or cuda:N")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = get_task("digits")
    device = torch.device(args.device)
    model = task.make_model(seed=args.seed).to(device)  # built on the host: the same init on every peer

    dht = DHT(initial_peers=args.bootstrap or None)  # none given: $P2PTRAIN_BOOTSTRAP, else a new swarm
    opt = DecentralizedOptimizer(
        task.make_optimizer(model.parameters(), lr=args.lr),  # AdamW
        dht=dht, run_id="digits-mlp", mode=args.mode, target_batch_size=args.target_batch_size, model=model,
        batch_size_per_step=args.batch_size, local_steps=args.local_steps, compression=args.compression,
    )

    def say(event: dict) -> None:
        if args.json:
            print(json.dumps(event), flush=True)
        elif event["event"] == "started":
            print(f"peer {event['peer_id']} joined at epoch {event['epoch']}; others join with", flush=True)
            for addr in event["addrs"]:  # one per network interface (any that the other machine reaches)
                print(f"  python examples/digits_mlp.py --bootstrap {addr}", flush=True)
        else:
            print("  ".join(f"{k}={v}" for k, v in event.items() if k != "event"), flush=True)

    addrs = [str(a) for a in dht.multiaddrs]  # every address others can dial this peer at
    say({"event": "started", "peer_id": str(dht.peer_id), "addr": addrs[0], "addrs": addrs, "epoch": opt.epoch})
    if args.wait_peers:
        opt.wait_for_peers(args.wait_peers)
    seed = args.data_seed if args.data_seed is not None else int(time.time_ns() % 2**31)
    batches = task.batches(args.batch_size, seed=seed)
    t0 = last = time.perf_counter()
    steps = 0
    try:
        while opt.epoch < args.epochs:
            x, y = next(batches)
            loss = task.loss(model, (x.to(device), y.to(device)))
            loss.backward()
            opt.step()  # a swarm step when the swarm has its batch; otherwise just accumulates
            opt.zero_grad()
            steps += 1
            if time.perf_counter() - last >= 1.0:
                last = time.perf_counter()
                say({"event": "progress", "epoch": opt.epoch, "loss": round(loss.item(), 4), "peers": opt.stats.peers,
                     "swarm_samples_per_s": round(opt.stats.swarm_sps),
                     "sent_MB": round(opt.stats.bytes_sent / 1e6, 2)})
    except KeyboardInterrupt:
        print("interrupted: leaving the swarm", file=sys.stderr)
    finally:
        opt.close()
        dht.close()
    metrics = task.evaluate(model)
    say({"event": "done", "epoch": opt.epoch, "steps": steps, "seconds": round(time.perf_counter() - t0, 2),
         "rounds": opt.stats.rounds, "bytes_sent": opt.stats.bytes_sent,
         **{k: round(v, 4) for k, v in metrics.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
