"""One peer of a swarm that is a torchrun job: DDP between the ranks of this machine, p2ptrain between machines.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py          # a new swarm
    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --bootstrap /ip4/.../p2p/12D3KooW...

The script is an ordinary DDP script with the optimizer wrapped. ``DecentralizedOptimizer`` finds
the process group: rank 0 runs the DHT node and averages with the swarm for all ranks (the
swarm sees one peer, counting every rank's samples); the other ranks follow it. Use gloo on
the CPU, nccl with a GPU per rank. ``p2ptrain peer --nproc-per-node K`` does all this for the
built-in examples.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from p2ptrain import DecentralizedOptimizer
from p2ptrain.tasks import get_task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="a peer already in the swarm (repeatable); none: start a new swarm")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--mode", choices=("sync", "diloco"), default="sync")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    task = get_task("digits")
    model = task.make_model(seed=0).to(device)  # the same init on every rank and peer
    ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None)
    opt = DecentralizedOptimizer(  # (on ranks other than 0: no DHT node, initial_peers unused)
        task.make_optimizer(model.parameters()), initial_peers=args.bootstrap or None, run_id="digits-ddp",
        mode=args.mode, target_batch_size=512, batch_size_per_step=32, local_steps=20, model=model,
    )
    if opt.ranks is None or opt.ranks.is_leader:
        print(f"peer {opt.dht.peer_id} at epoch {opt.epoch}; others join with --bootstrap {opt.dht.multiaddrs[0]}",
              flush=True)
    batches = task.batches(32, seed=int.from_bytes(os.urandom(4), "big"))  # (other data on every rank)
    try:
        while opt.epoch < args.epochs:
            x, y = next(batches)
            task.loss(ddp, (x.to(device), y.to(device))).backward()  # DDP averages the ranks' gradients
            opt.step()  # the leader averages with the swarm and sends every rank the result
            opt.zero_grad()
        opt.finish_round()
        print(f"rank {rank}: epoch {opt.epoch}, test {task.evaluate(model)}", flush=True)
    finally:
        opt.close()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
