"""One rank of a peer that trains digits under FSDP2 (gloo, CPU) for tests/test_fsdp.py; with
``--world 1 --plain`` a plain single-process peer. Prints JSON lines: ``gated`` (with
``--bootstrap-fifo``: set up, waiting to be told where to join), ``started`` (rank 0: its
multiaddrs and epoch), ``epoch`` (rank 0, each new one), ``done`` (accuracy, epoch, mismatches; the
rank's outer shard saved to ``--out``)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from p2ptrain import DecentralizedOptimizer
from p2ptrain.optim.fsdp import rank_dht
from p2ptrain.tasks import get_task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--peer", type=int, default=0, help="this peer's index (its data slice)")
    ap.add_argument("--peers", type=int, default=4, help="peers the data is split between")
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--bootstrap-fifo", default="", help="read --bootstrap from this FIFO once set up (a head start)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--wait", type=int, default=0, help="peers to wait for before training")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--stop-file", default="", help="train until the epoch this file names (once it exists)")
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (a test that times out asks for the stacks)
    torch.set_num_threads(1)
    task = get_task("digits", hidden=33, depth=1)  # (33 rows: uneven shards over 2 ranks)
    model = task.make_model(seed=0)
    ranks = None
    if not a.plain:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
        from torch.distributed.fsdp import fully_shard

        from p2ptrain.optim.ranks import PeerRanks

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        ranks = PeerRanks() if a.world > 1 else None
    if a.bootstrap_fifo:  # (imports and the process group done: join once the test says where)
        print(json.dumps({"event": "gated"}), flush=True)
        with open(a.bootstrap_fifo) as fifo:
            a.bootstrap = fifo.readline().strip()
    opt = DecentralizedOptimizer(
        task.make_optimizer(model.parameters()), run_id="fsdp-digits", mode="diloco", local_steps=8,
        outer_lr=0.7, batch_size_per_step=32, target_group_size=8, matchmaking_timeout=5.0, model=model,
        dht=rank_dht([a.bootstrap] if a.bootstrap else [], ranks, listen=("127.0.0.1", 0)),
        checkpoint_every=4 if a.ckpt_dir else None, checkpoint_dir=a.ckpt_dir or None,
    )
    if opt.fsdp is None or opt.fsdp.rank == 0:
        print(json.dumps({"event": "started", "multiaddrs": [str(m) for m in opt.dht.multiaddrs],
                          "epoch": opt.epoch}), flush=True)
    start_epoch = opt.epoch
    if a.wait:
        opt.wait_for_peers(a.wait, timeout=60)
    batches = task.batches(32, seed=1, rank=a.peer * a.world + a.rank, world=a.peers * a.world)
    steps = 0
    while True:  # every rank stops at the same step: once all ranks reached the epoch
        done = int(opt.epoch >= start_epoch + a.epochs and opt.epoch >= _stop_epoch(a.stop_file))
        if (ranks.sum(done) == a.world) if ranks is not None else done:
            break
        opt.zero_grad()
        task.loss(model, next(batches)).backward()  # (FSDP's collectives: every rank takes part)
        epoch = opt.epoch
        if done and ranks is not None:  # no round past the epoch: only the step's own collective
            opt.fsdp.hold(32)
        else:
            opt.step()
            steps += 1
        if opt.epoch != epoch and (opt.fsdp is None or opt.fsdp.rank == 0):
            print(json.dumps({"event": "epoch", "epoch": opt.epoch}), flush=True)
    with torch.no_grad():  # the model as of the last round: the outer parameters
        for p, outer in zip(opt.params, opt._outer, strict=True):
            p.copy_(outer)
    accuracy = task.evaluate(model)["accuracy"]
    save_file({f"p{i}": t.contiguous() for i, t in enumerate(opt._outer)}, a.out)
    print(json.dumps({"event": "done", "rank": a.rank, "accuracy": accuracy, "epoch": opt.epoch,
                      "start_epoch": start_epoch, "steps": steps, "mismatches": opt.mismatches,
                      "run_id": opt.run_id}), flush=True)
    opt.close()
    if not a.plain:
        dist.destroy_process_group()


def _stop_epoch(path: str) -> int:
    if not path:
        return 0
    try:
        return int(open(path).read())
    except (OSError, ValueError):  # (not written yet)
        return 1 << 30


if __name__ == "__main__":
    sys.exit(main())
