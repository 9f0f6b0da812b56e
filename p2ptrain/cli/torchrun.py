"""``p2ptrain peer --nproc-per-node K``: one peer that is a torchrun job of K ranks (DDP or FSDP inside).

The command runs ``python -m torch.distributed.run`` (standalone, on this machine) with the same
command line; each of its K workers sees ``$P2PTRAIN_RANK_WORKER``, joins the process group
(gloo on the CPU, nccl on CUDA) and trains: rank 0 is the peer (DHT node, averaging with the
swarm), the others follow it (see :mod:`p2ptrain.optim.ranks`). With ``--fsdp`` the model is
sharded over the ranks instead, and every rank averages its shard with the same rank of the
other peers, through a DHT node of its own (:mod:`p2ptrain.optim.fsdp`). ``torchrun ... -m
p2ptrain peer ...`` started by hand runs the same way.

When a rank dies, torchrun stops the others (SIGTERM): the leader leaves the swarm cleanly and
the swarm carries on without the peer. With ``--max-restarts N`` torchrun then starts all K
workers again, up to N times: the restarted peer joins as a newcomer (a new PeerID unless
``--key-file`` keeps it) and loads the swarm's state before it trains.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from datetime import timedelta
from typing import Any

from dht import ConfigError

#: set in the environment of the workers torchrun starts for ``--nproc-per-node``
WORKER_ENV = "P2PTRAIN_RANK_WORKER"
#: seconds a collective between the ranks may wait for a rank before it fails (the peer then leaves)
RANK_TIMEOUT = 120.0


def add_ranks_args(p: argparse.ArgumentParser) -> None:
    """``--nproc-per-node`` and ``--max-restarts`` (training flags: ``p2ptrain swarm`` passes them on)."""
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                   help="run this peer as a torchrun job of K ranks (DDP inside, or FSDP with --fsdp: gloo on the "
                   "CPU, nccl on CUDA); with DDP rank 0 averages with the swarm for all of them (default: 1, one "
                   "process)")
    p.add_argument("--fsdp", action="store_true",
                   help="with --nproc-per-node (or under torchrun): shard the model over the ranks (FSDP2) instead "
                   "of a replica on each; each rank averages its own shard with the same rank of the other peers, "
                   "which must use --fsdp and the same K (a fixed --listen port: rank r listens on port + r)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --nproc-per-node: when a rank fails, torchrun restarts all ranks up to N times; "
                   "each restart rejoins the swarm as a newcomer (default: 0, the peer exits)")


def check_ranks_args(args: argparse.Namespace) -> None:
    """A ConfigError for rank options that cannot work."""
    if args.nproc_per_node < 1:
        raise ConfigError("--nproc-per-node must be at least 1")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts cannot be negative")
    if (args.nproc_per_node > 1 or in_torchrun()) and getattr(args, "dataset", None):
        raise ConfigError("--dataset is not supported with --nproc-per-node or torchrun yet (the ranks would need "
                          "the swarm's shards without a DHT node of their own)")
    if getattr(args, "fsdp", False) and args.nproc_per_node < 2 and not in_torchrun():
        raise ConfigError("--fsdp shards the model over the ranks of a torchrun job: give --nproc-per-node K "
                          "(K >= 2), or start this command with torchrun")
    if getattr(args, "fsdp", False) and getattr(args, "save", None):
        raise ConfigError("--save is not supported with --fsdp (no rank holds the whole model): use "
                          "--checkpoint-every and export the ranks' checkpoints with p2ptrain ckpt export")
    if args.nproc_per_node > 1 and getattr(args, "script", None):
        raise ConfigError("--nproc-per-node runs --example peers; run your own script with torchrun directly "
                          "(DecentralizedOptimizer finds the process group itself)")


def is_worker() -> bool:
    """Whether this process is one of the ranks a ``--nproc-per-node`` peer (or torchrun) started."""
    return os.environ.get(WORKER_ENV) == "1" or in_torchrun()


def in_torchrun() -> bool:
    """Whether torchrun started this process (its agent sets these for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def launch(args: argparse.Namespace) -> int:
    """Run this command again as a torchrun job of ``--nproc-per-node`` workers; its exit status.
    SIGINT and SIGTERM are passed on once (torchrun runs in a session of its own)."""
    argv = getattr(args, "argv", None)
    if argv is None:
        raise ConfigError("--nproc-per-node: the command line to give the ranks is unknown")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={args.nproc_per_node}", f"--max-restarts={args.max_restarts}",
           "-m", "p2ptrain", *argv]
    from ..children import die_with_parent

    proc = subprocess.Popen(cmd, env={**os.environ, WORKER_ENV: "1"}, start_new_session=True,
                            preexec_fn=die_with_parent)

    def forward(sig: int, _frame: Any) -> None:
        proc.send_signal(sig)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def init_worker(device: str) -> Any:
    """Join the process group torchrun set up (nccl for a CUDA ``device`` with a GPU per rank, else
    gloo); this rank's PeerRanks."""
    import torch.distributed as dist

    from ..optim.ranks import PeerRanks

    import torch

    # nccl wants a GPU per rank; ranks that share one talk through gloo
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    backend = "nccl" if cuda and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    from ..children import die_with_parent

    die_with_parent()  # (torchrun killed: no rank outlives it)
    env = os.environ
    rank, world, timeout = int(env["RANK"]), int(env["WORLD_SIZE"]), timedelta(seconds=RANK_TIMEOUT)
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # (else rank 0 serves the store)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=not agent and rank == 0,
                          timeout=timeout)
    # keys of this attempt only: after a restart the store may still hold the dead ranks' addresses
    store = dist.PrefixStore(f"p2ptrain/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return PeerRanks.detect()


def close_worker(ranks: Any) -> None:
    """Leave the process group (after training), all ranks together: one destroying it while
    another still talks to it aborts the process."""
    import torch.distributed as dist

    from ..optim.ranks import RankFailure

    if ranks is None or not dist.is_initialized():
        return
    try:
        ranks.barrier()
    except RankFailure:
        return  # (a rank is gone: nobody to leave with; the process exits)
    dist.destroy_process_group()
