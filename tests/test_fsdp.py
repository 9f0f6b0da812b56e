"""FSDP inside a peer (gloo, CPU, real processes on 127.0.0.1): two peers of two fully_shard
ranks train digits, each rank averaging its own shard with the other peer's; a joiner of two
ranks loads its shards from the swarm; an unsharded peer of the run is told why it never
averages with them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from p2ptrain.averaging.schema import parse_summary, schema_mismatch_message, shards_of, tensor_schema
from p2ptrain.checkpoint.store import CheckpointStore
from p2ptrain.tasks import get_task
from p2ptrain.testing.events import EventProcess

WORKER = str(Path(__file__).with_name("fsdp_peer.py"))

pytestmark = pytest.mark.timeout(240)
#: the epoch of A and B at which C and D join
JOIN = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank(EventProcess):
    """One worker process (a rank, or a plain peer), its output file beside it. ``gated``: it
    starts at once but joins the swarm only once :meth:`let_in` tells it where."""

    def __init__(self, out: Path, gated: bool = False, **args: Any):
        self.fifo = out.with_suffix(".boot") if gated else None
        if self.fifo is not None:
            os.mkfifo(self.fifo)
            args["bootstrap_fifo"] = self.fifo
        argv = [sys.executable, WORKER, "--out", str(out)]
        for k, v in args.items():
            argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
        super().__init__(argv, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        self.out = out

    def let_in(self, bootstrap: str) -> None:
        """Have a gated rank join the swarm through ``bootstrap`` (once it is set up)."""
        assert self.fifo is not None
        self.wait_for(lambda e: e["event"] == "gated")
        with open(self.fifo, "w") as fifo:
            fifo.write(bootstrap + "\n")


def _drain(rank: Rank) -> list[dict[str, Any]]:
    out = []
    while not rank.events.empty():
        out.append(rank.events.get())
    return out


def _peer(tmp: Path, name: str, world: int, gated: bool = False, **args: Any) -> list[Rank]:
    """The ranks of one peer (``gated``: its leader waits for ``let_in``; the others join through it)."""
    port = _free_port()
    return [Rank(tmp / f"{name}{r}.safetensors", gated=gated and r == 0, rank=r, world=world, port=port, **args)
            for r in range(world)]


def test_fsdp_peers_average_their_shards_a_joiner_catches_up_and_an_unsharded_peer_is_refused(tmp_path):
    procs: list[Rank] = []
    try:
        stop = tmp_path / "stop"  # A, B and C train until the epoch written there, once D is done
        store = tmp_path / "store"  # (A's and B's ranks save every checkpoint of their shard there)
        # every process starts at once (imports take most of the time); B joins A once A is up, then
        # a joiner of two ranks, C, and a plain single-process peer of the same run, D, at epoch JOIN
        a = _peer(tmp_path, "a", 2, peer=0, wait=2, epochs=6, stop_file=stop, ckpt_dir=store)
        b = _peer(tmp_path, "b", 2, gated=True, peer=1, wait=2, epochs=6, stop_file=stop, ckpt_dir=store)
        c = _peer(tmp_path, "c", 2, gated=True, peer=2, epochs=2, stop_file=stop)
        d = Rank(tmp_path / "d.safetensors", gated=True, plain=True, peer=3, epochs=3)
        procs += [*a, *b, *c, d]
        boot = a[0].wait_for(lambda e: e["event"] == "started")["multiaddrs"][0]
        b[0].let_in(boot)
        a[0].wait_for(lambda e: e["event"] == "epoch" and e["epoch"] >= JOIN)
        for gated in (c[0], d):
            gated.let_in(boot)
        done = {"d": [d.wait_for(lambda e: e["event"] == "done")]}
        joined = c[0].wait_for(lambda e: e["event"] == "started")["epoch"]
        c[0].wait_for(lambda e: e["event"] == "epoch" and e["epoch"] >= joined + 2)  # (it trained on)
        last = max(e["epoch"] for r in (a[0], c[0]) for e in r.seen + _drain(r) if e["event"] == "epoch")
        tmp = stop.with_suffix(".tmp")
        tmp.write_text(str(last + 2))
        tmp.rename(stop)
        done.update({name: [r.wait_for(lambda e: e["event"] == "done") for r in ranks]
                     for name, ranks in (("a", a), ("b", b), ("c", c))})
    finally:
        for p in procs:
            p.kill()
    # every rank of every peer, the joiner's too, ends with its shard of the same model (the last round's)
    for r in range(2):
        ours = load_file(a[r].out)
        for peer in (b, c):
            theirs = load_file(peer[r].out)
            diff = {k: (ours[k] - theirs[k]).abs().max().item() for k in ours}
            assert not any(diff.values()), (r, diff, {n: [(e["epoch"], e["steps"]) for e in done[n]] for n in "abc"})
    assert load_file(a[0].out)["p0"].shape == (17, 64) and load_file(a[1].out)["p0"].shape == (16, 64)
    accuracy = [e["accuracy"] for e in done["a"] + done["b"] + done["c"]]
    assert min(accuracy) >= 0.85 and min(accuracy) == max(accuracy), accuracy
    # the joiner's ranks each loaded their shard of the swarm's state (and trained on with it, above;
    # the shard swarms keep their own epochs: A's other rank may have been a round behind at JOIN)
    assert all(e["start_epoch"] >= JOIN - 1 for e in done["c"]), done["c"]
    # the unsharded peer and the sharded ones: each told why they never average together
    said = " ".join(done["d"][0]["mismatches"].values())
    assert "1 rank (unsharded)" in said and "over 2 ranks" in said, done["d"]
    said = " ".join(done["a"][0]["mismatches"].values())
    assert "FSDP world size 1" in said and "world size 2" in said, done["a"]
    # the shards' checkpoints of one epoch export as one file of the whole model
    infos = CheckpointStore(store).list()
    epochs = {run: {i.epoch: i.cid for i in infos if i.run_id == run} for run in ("fsdp-digits", "fsdp-digits.shard1")}
    epoch = max(set(epochs["fsdp-digits"]) & set(epochs["fsdp-digits.shard1"]))
    out = tmp_path / "model.safetensors"
    cli = [sys.executable, "-m", "p2ptrain", "ckpt", "export", "--data-dir", str(store)]
    whole = subprocess.Popen([*cli, epochs["fsdp-digits.shard1"][epoch], epochs["fsdp-digits"][epoch], str(out)],
                             stderr=subprocess.PIPE, text=True)
    # (and at the same time) one shard alone is refused, naming what it is
    half = subprocess.Popen([*cli, epochs["fsdp-digits"][epoch], str(tmp_path / "half.safetensors")],
                            stderr=subprocess.PIPE, text=True)
    try:
        said = [p.communicate(timeout=60)[1] for p in (whole, half)]
    finally:
        for p in (whole, half):
            p.kill()
    assert whole.returncode == 0, said[0]
    assert half.returncode != 0 and "rank 0 of 2" in said[1], said[1]
    task = get_task("digits", hidden=33, depth=1)
    model = task.make_model(seed=1)
    model.load_state_dict(load_file(out))  # (strict: every name, whole shapes)
    assert task.evaluate(model)["accuracy"] >= 0.8


def test_the_world_size_is_in_the_schema_and_its_mismatch_names_both_sizes():
    tensors = [("w", torch.zeros(17, 64)), ("b", torch.zeros(17))]
    plain, sharded = tensor_schema(tensors, "none"), tensor_schema(tensors, "none", shards=2)
    assert plain.hash != sharded.hash and plain.key == plain.hash and sharded.key == f"{sharded.hash}/k2"
    assert shards_of(plain.key) == 1 and shards_of(sharded.key) == 2
    three = tensor_schema([("w", torch.zeros(11, 64)), ("b", torch.zeros(11))], "none", shards=3)
    said = schema_mismatch_message(sharded, three.summary(), peer="X", run="r")
    assert "over 3 ranks (FSDP world size 3)" in said and "ours over 2 ranks (world size 2)" in said, said
    assert parse_summary({**three.summary(), "k": 0}) is None  # (a peer's claim: bounded)


def test_the_ranks_of_an_fsdp_peer_agree_on_ending_an_epoch_and_stopping_and_a_holding_rank_matches_the_steps():
    """(no processes: the in-peer sums stand in) A rank whose shard swarm is not due ends its sync
    epoch when another rank's is; a rank that holds takes part in as many collectives as a step
    (else the peer's ranks deadlock); poll stops every rank on one's stop, or once all are done."""
    from p2ptrain.optim.fsdp import FsdpShard

    def rank(others: int, sync: bool = True) -> tuple[FsdpShard, list[int]]:
        """A rank of 2 whose other rank adds ``others`` to every sum; the values it contributed."""
        shard, sent = FsdpShard.__new__(FsdpShard), []
        shard.sync, shard.world_size, shard.dparams, shard.local = sync, 2, [], []
        shard.ranks = types.SimpleNamespace(sum=lambda v: sent.append(v) or v + others)
        return shard, sent

    shard, _ = rank(others=1)
    assert shard.end_epoch(False) and shard.end_epoch(True)  # the other rank found it due: both end
    shard, _ = rank(others=0)
    assert not shard.end_epoch(False) and shard.end_epoch(True)
    for sync in (True, False):  # a step's collectives: the batch's sum, then (sync) the epoch's end
        stepping, held = rank(others=0, sync=sync), rank(others=0, sync=sync)
        stepping[0].begin_step(32)
        if sync:
            stepping[0].end_epoch(False)
        held[0].hold(32)
        assert len(stepping[1]) == len(held[1]) == 1 + sync and held[1][0] == 32
    assert rank(others=1)[0].poll(done=True, stop=False) == "stop"  # both done
    assert rank(others=0)[0].poll(done=True, stop=False) == "hold"  # the other trains on
    assert rank(others=0)[0].poll(done=False, stop=False) == "step"
    assert rank(others=3)[0].poll(done=False, stop=False) == "stop"  # the other was told to stop
    assert rank(others=0)[0].poll(done=False, stop=True) == "stop"
