"""Train a small character-level transformer LM with a swarm of peers, DiLoCo style (offline, CPU).

    python examples/char_lm.py                   # the first peer: prints the address to join
    python examples/char_lm.py --bootstrap /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW...   # more peers
    python examples/char_lm.py --dataset bafkr4i... --bootstrap ...   # train on a 'p2ptrain data add' CID

The text is the documentation that ships with Python itself (nothing is downloaded), so every
peer builds the same corpus. By default each peer takes ``--local-steps`` AdamW steps on its own,
then the swarm averages what changed (int8-compressed pseudo-gradients) and applies a Nesterov
outer step: two orders of magnitude fewer bytes than averaging gradients every step. The script
prints validation loss and perplexity at every outer round and a sample of generated text at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from p2ptrain import DHT, DecentralizedOptimizer
from p2ptrain.tasks import get_task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="a peer already in the swarm (repeatable); none: start a new swarm")
    p.add_argument("--mode", choices=("sync", "diloco"), default="diloco")
    p.add_argument("--epochs", type=int, default=10, help="outer rounds (diloco) or global steps (sync); default 10")
    p.add_argument("--local-steps", type=int, default=50, help="inner steps per outer round (diloco, default 50)")
    p.add_argument("--target-batch-size", type=int, default=256, help="swarm samples per global step (sync)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per local step")
    p.add_argument("--compression", default=None,
                   help="none, fp16, bf16, int8, int8-outlier or topk (default: int8 for diloco)")
    p.add_argument("--lr", type=float, default=None, help="inner learning rate (default: the task's)")
    p.add_argument("--seed", type=int, default=0, help="model init seed: the same on every peer")
    p.add_argument("--data-seed", type=int, default=None, help="data order (default: different on every peer)")
    p.add_argument("--dataset", metavar="CID", help="train on this dataset ('p2ptrain data add' printed its CID), "
                   "its shards fetched from the peers that hold it; default: the built-in corpus")
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 when several peers share a machine)")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu (default), cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    return p.parse_args(argv)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: str, length: int, context: int) -> str:
    """Greedy-ish sampling (temperature 0.8) from the model, ASCII in, ASCII out."""
    model.eval()
    ids = torch.tensor([[min(ord(c), 127) for c in prompt]], device=next(model.parameters()).device)
    gen = torch.Generator().manual_seed(0)
    for _ in range(length):
        logits = model(ids[:, -context:])[0, -1] / 0.8
        nxt = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen).to(ids.device)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return "".join(chr(i) for i in ids[0].tolist())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    task = get_task("char_lm")
    device = torch.device(args.device)
    model = task.make_model(seed=args.seed).to(device)  # built on the host: the same init on every peer

    dht = DHT(initial_peers=args.bootstrap or None)  # none given: $P2PTRAIN_BOOTSTRAP, else a new swarm
    opt = DecentralizedOptimizer(
        task.make_optimizer(model.parameters(), lr=args.lr),  # AdamW inside; Nesterov SGD outside
        dht=dht, run_id="char-lm", mode=args.mode, local_steps=args.local_steps, model=model,
        target_batch_size=args.target_batch_size, batch_size_per_step=args.batch_size, compression=args.compression,
    )

    def say(event: dict) -> None:
        if args.json:
            print(json.dumps(event), flush=True)
        elif event["event"] == "started":
            print(f"peer {event['peer_id']} joined at epoch {event['epoch']}; others join with", flush=True)
            for addr in event["addrs"]:  # one per network interface (any that the other machine reaches)
                print(f"  python examples/char_lm.py --bootstrap {addr}", flush=True)
        else:
            print("  ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "sample")), flush=True)
            if "sample" in event:
                print(event["sample"], flush=True)

    addrs = [str(a) for a in dht.multiaddrs]  # every address others can dial this peer at
    say({"event": "started", "peer_id": str(dht.peer_id), "addr": addrs[0], "addrs": addrs, "epoch": opt.epoch})
    seed = args.data_seed if args.data_seed is not None else int(time.time_ns() % 2**31)
    dataset = None
    if args.dataset:  # each epoch, the swarm reads every shard about once between its peers
        from p2ptrain.data import SwarmDataset

        dataset = SwarmDataset(dht, args.dataset, server=opt.state_sync.server)  # one state server per host
        batches = task.record_batches(iter(dataset), args.batch_size)
    else:
        batches = task.batches(args.batch_size, seed=seed)
    t0 = time.perf_counter()
    epoch = opt.epoch
    try:
        while opt.epoch < args.epochs:
            model.train()
            x, y = next(batches)
            loss = task.loss(model, (x.to(device), y.to(device)))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()  # an inner step; every --local-steps, an outer round with the swarm
            opt.zero_grad()
            if opt.epoch != epoch:
                epoch = opt.epoch
                val = task.evaluate(model)
                say({"event": "round", "epoch": epoch, "train_loss": round(loss.item(), 3),
                     "val_loss": round(val["loss"], 3), "perplexity": round(val["perplexity"], 2),
                     "peers": opt.stats.peers, "sent_MB": round(opt.stats.bytes_sent / 1e6, 2),
                     "seconds": round(time.perf_counter() - t0, 1)})
    except KeyboardInterrupt:
        print("interrupted: leaving the swarm", file=sys.stderr)
    finally:
        if dataset is not None:
            dataset.close()
        opt.close()
        dht.close()
    val = task.evaluate(model)
    say({"event": "done", "epoch": opt.epoch, "val_loss": round(val["loss"], 4),
         "perplexity": round(math.exp(val["loss"]), 2), "bytes_sent": opt.stats.bytes_sent,
         "seconds": round(time.perf_counter() - t0, 1),
         "sample": generate(model, "The ", 120, task.options["context"])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
