"""Peers that are torchrun jobs (``p2ptrain peer --nproc-per-node 2``, DDP over gloo on the CPU):
the ranks of every peer end alike, a joiner of two ranks catches up, a dead rank takes its peer
out of the swarm (which carries on) and torchrun's restart rejoins it as a newcomer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from p2ptrain.testing.events import EventProcess, descendants

CLI = [sys.executable, "-m", "p2ptrain"]
#: a small run on loopback, one torch thread per rank
COMMON = ["--json", "--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1", "--target-batch-size", "256"]

pytestmark = pytest.mark.timeout(240)  # (bounded by the waits below; ~55 s on a quiet 2-core machine)


class Peer(EventProcess):
    """A ``p2ptrain peer`` process (for --nproc-per-node: its launcher, torchrun and ranks under it)."""

    def __init__(self, env: dict[str, str], *args: str):
        super().__init__([*CLI, "peer", *COMMON, *args], env=env)

    def dones(self, n: int, timeout: float = 90.0) -> list[dict[str, Any]]:
        """The ``done`` events of all ``n`` ranks."""
        out = [e for e in self.seen if e["event"] == "done"]
        while len(out) < n:
            out.append(self.wait_for(lambda e: e["event"] == "done", timeout))
        return out

    def addr(self) -> str:
        started = next((e for e in self.seen if e["event"] == "started"), None) or \
            self.wait_for(lambda e: e["event"] == "started")
        return started["multiaddrs"][0]


@pytest.fixture
def peers(tmp_path) -> Iterator[Any]:
    """``peers(*flags)``: a started Peer; all killed at the end. Their caches and checkpoints go to ``tmp_path``."""
    made: list[Peer] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "P2PTRAIN_DATA_DIR": str(tmp_path / "data")}

    def start(*args: str) -> Peer:
        made.append(Peer(env, *args))
        return made[-1]

    yield start
    for p in made:
        p.kill()


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the worker of local rank ``rank`` that the ``--nproc-per-node`` peer ``launcher`` runs."""
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"LOCAL_RANK") == str(rank).encode() and b"P2PTRAIN_RANK_WORKER" in env:
            return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


RANKS_SCRIPT = """
import torch, torch.distributed as dist
from p2ptrain.optim.ranks import PeerRanks, RankFailure
dist.init_process_group("gloo")
r = PeerRanks.detect()
assert r is not None and r.world_size == 2 and r.is_leader == (r.rank == 0)
mine = [torch.full((3,), float(r.rank + 1)), torch.full((2, 2), 7.0 * r.rank), torch.arange(4) * r.rank]
r.broadcast(mine)  # the leader's values everywhere, every dtype
assert mine[0].tolist() == [1.0] * 3 and mine[1].abs().sum() == 0 and mine[2].tolist() == [0] * 4
assert r.decide({"epoch": 5, "lr": [0.1]} if r.is_leader else None) == {"epoch": 5, "lr": [0.1]}
big = {"blob": "x" * 3000}  # (more than one broadcast's worth)
assert r.decide(big if r.is_leader else None) == big
assert r.sum(10 + r.rank) == 21
t = torch.tensor([float(r.rank)])
r.all_reduce_mean([t])
assert t.item() == 0.5
from torch.nn.parallel import DistributedDataParallel
model = DistributedDataParallel(torch.nn.Linear(3, 1))
assert r.forward_backward(lambda: model(torch.ones(2, 3)).sum()).item() == model(torch.ones(2, 3)).sum().item()
if r.rank == 1:
    raise SystemExit(0)  # gone: the leader's next collective fails, DDP's all-reduce too
try:
    r.forward_backward(lambda: model(torch.ones(2, 3)).sum())
except RankFailure as e:
    print("RankFailure in backward:", e)
try:
    r.decide("anyone?")
except RankFailure as e:
    print("RankFailure:", e)
"""


def test_peer_ranks_collectives(tmp_path):
    """PeerRanks on two gloo ranks: broadcast, decide (short and long), sum, mean; a rank gone is a RankFailure."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=90,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "RankFailure in backward: a rank of this peer failed" in out.stdout, out.stderr[-3000:]
    assert "RankFailure: a rank of this peer failed" in out.stdout, out.stderr[-3000:]


def test_two_ranks_per_peer_train_alike_and_a_dead_rank_restarts_its_peer_as_a_joiner(peers, tmp_path):
    """2 peers x 2 ranks train digits (sync). SIGKILL one rank of peer A: A's leader leaves the
    swarm, which trains on (B alone); torchrun (--max-restarts 1) starts A again, and the new
    2-rank peer joins as a newcomer (one download by its leader, broadcast inside) and catches
    up: in the end all 4 ranks hold the same parameters."""
    epochs = 80
    b = peers("--nproc-per-node", "2", "--epochs", str(epochs), "--wait-peers", "2", "--compute-delay", "0.05",
              "--checkpoint-every", str(epochs))
    a = peers("--nproc-per-node", "2", "--max-restarts", "1", "--epochs", str(epochs), "--bootstrap", b.addr(),
              "--compute-delay", "0.05")
    first = a.wait_for(lambda e: e["event"] == "started")
    assert first["ranks"] == 2
    b.wait_for(lambda e: e["event"] == "progress" and e["epoch"] >= 3 and e["peers"] == 2)
    os.kill(_rank_pid(a.proc.pid, 1), signal.SIGKILL)
    killed_at = b.wait_for(lambda e: e["event"] == "progress")["epoch"]
    # the swarm carries on without A
    b.wait_for(lambda e: e["event"] == "progress" and e["epoch"] >= killed_at + 3)
    # torchrun's restart: a new leader joins as a newcomer and loads the swarm's state
    again = a.wait_for(lambda e: e["event"] == "started")
    assert again["peer_id"] != first["peer_id"], again
    log = "".join(a.stderr)
    assert "a rank of this peer failed" in log and "this peer left the swarm" in log
    ends = a.dones(2) + b.dones(2)
    assert sorted(e.get("rank", 0) for e in ends) == [0, 0, 1, 1]
    assert len({e["params_digest"] for e in ends}) == 1, ends
    assert all(e["epoch"] == epochs for e in ends)
    leaders = [e for e in ends if "rank" not in e]
    # every rank's samples count: a step of a 2-rank peer is 2 batches of 32
    assert all(e["samples"] == 64 * e["steps"] and e["rounds"] >= 1 for e in leaders)
    # the restarted A took the swarm's state (usually at its start; under load its first look at
    # the swarm may miss B, and it loads once it sees itself behind)
    assert leaders[0]["state_loads"] >= 1, leaders[0]
    # (a 4-peer swarm of single processes reaches about as much: benchmarks/README.md)
    assert min(e["metrics"]["accuracy"] for e in ends) > 0.9
    for p in (a, b):
        assert p.proc.wait(timeout=30) == 0, "".join(p.stderr)[-2000:]
    # the leader's checkpoint exports as one plain file of the whole model (no DDP "module." names)
    env = {**os.environ, "P2PTRAIN_DATA_DIR": str(tmp_path / "data")}
    listed = subprocess.run([*CLI, "ckpt", "ls", "--json"], capture_output=True, text=True, timeout=60, env=env)
    newest = json.loads(listed.stdout)[0]
    assert newest["epoch"] == epochs
    out = tmp_path / "model.safetensors"
    subprocess.run([*CLI, "ckpt", "export", newest["cid"], str(out)], check=True, timeout=60, env=env)
    from safetensors.torch import load_file

    from p2ptrain.tasks import get_task

    get_task("digits").make_model(seed=1).load_state_dict(load_file(str(out)), strict=True)
