"""Peers that start from a checkpoint, and peers whose partners leave: the swarm stays one.

In-process (threads, real loopback DHT nodes): a peer resuming from a checkpoint is not seen by
the swarm until it holds the checkpoint's state (seen at epoch 0 meanwhile, it was counted by
peers waiting for the swarm, which then trained without it); a peer whose round partner finished
and left steps with its own gradients instead of failing to load a state nobody serves. Across
processes: ``p2ptrain swarm`` run, then run again with more epochs, resumes every peer at the
checkpoint's epoch and ends with one state.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from p2ptrain import DHT, DecentralizedOptimizer
from p2ptrain.checkpoint.autosave import Checkpointer

pytestmark = pytest.mark.timeout(120)

RUN = "resume-test"


def make(dht: DHT, seed: int, store: object = None, target: int = 16,
         **kw: object) -> tuple[torch.nn.Module, DecentralizedOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), dht=dht, run_id=RUN,
                                 target_batch_size=target, batch_size_per_step=16, checkpoint_dir=store, **kw)
    return model, opt


def step(model: torch.nn.Module, opt: DecentralizedOptimizer, gen: torch.Generator, bs: int = 16) -> None:
    x = torch.randn(bs, 8, generator=gen)
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step(batch_size=bs)
    opt.zero_grad()


@pytest.fixture
def nodes(dhts):
    return dhts


def others_seen(opt: DecentralizedOptimizer) -> dict[str, int]:
    """Peer id -> epoch of every other peer in a fresh read of ``opt``'s swarm."""
    view = opt._loop.run(opt.tracker.refresh_now(timeout=10))
    me = opt.tracker.me.peer
    return {str(p.peer): p.epoch for p in (*view.peers, *view.behind) if p.peer != me}


def test_a_resuming_peer_is_seen_only_at_the_epoch_it_resumed(tmp_path, nodes, monkeypatch):
    store = tmp_path / "data"
    first = nodes()
    model, opt = make(first, 0, store, checkpoint_every=3)
    gen = torch.Generator().manual_seed(1)
    while opt.epoch < 6:  # alone, every step is a global epoch: checkpoints at 3 and 6
        step(model, opt, gen)
        opt.checkpointer.flush(30)
    opt.close()

    _, a = make(first, 1, store, checkpoint_every=3)
    assert a.epoch == a.stats.resumed_epoch == 6
    entered, go = threading.Event(), threading.Event()
    find = Checkpointer.find

    def slow_find(self, *args, **kw):  # the second peer is still looking for its checkpoint
        entered.set()
        assert go.wait(60)
        return find(self, *args, **kw)

    monkeypatch.setattr(Checkpointer, "find", slow_find)
    made: list[DecentralizedOptimizer] = []
    second = nodes()
    joiner = threading.Thread(target=lambda: made.append(make(second, 2, store, checkpoint_every=3)[1]))
    joiner.start()
    try:
        assert entered.wait(60)
        # while it resumes, the swarm neither counts it nor sees it at epoch 0
        assert others_seen(a) == {}
        assert a.wait_for_peers(2, timeout=1.0) == 1
    finally:
        go.set()
        joiner.join(60)
    b = made[0]
    try:
        assert b.epoch == b.stats.resumed_epoch == 6 and b.stats.state_loads == 0
        assert a.wait_for_peers(2, timeout=30) == 2
        assert others_seen(a) == {str(second.peer_id): 6}
    finally:
        b.close()
        a.close()


def test_a_peer_whose_partner_left_steps_with_its_own_gradients(nodes, caplog):
    """Its round expected the partner (which had reported its epoch), met nobody, and the
    partner is gone: nobody has a state to load, so the update is ours, with no warning."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.optim")
    ma, a = make(nodes(), 0, target=64)
    mb, b = make(nodes(), 0, target=64)
    try:
        assert a.wait_for_peers(2, timeout=30) == 2 and b.wait_for_peers(2, timeout=30) == 2
        gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
        pairs = [(ma, a, gens[0]), (mb, b, gens[1])]
        trainers = [threading.Thread(target=train, args=(*pair, 3)) for pair in pairs]
        for t in trainers:
            t.start()
        for t in trainers:
            t.join(60)
        assert a.epoch == b.epoch == 3 and b.stats.rounds > 0
        deadline = time.monotonic() + 30
        while b._loop.run(b.tracker.refresh_now()).num_peers < 2 and time.monotonic() < deadline:
            pass  # b sees a at their epoch
        before = [p.detach().clone() for p in mb.parameters()]
        caplog.clear()
        # a full batch: b ends its epoch and waits for a in the round
        stepper = threading.Thread(target=step, args=(mb, b, gens[1], 64))
        stepper.start()
        while not b.tracker.me.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.tracker.me.ready
        a.close()  # a leaves while b waits for it
        stepper.join(60)
        assert b.epoch == 4 and b.stats.state_loads == 0
        assert not all(torch.equal(p, q) for p, q in zip(mb.parameters(), before)), "b skipped its update"
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        a.close()
        b.close()


def test_a_peer_that_finished_stays_until_the_one_behind_loaded_its_state(nodes):
    """drain(): the peer behind meets a provider ahead of it, not a round with nobody (the test
    above), and ends the run with the same parameters."""
    ma, a = make(nodes(), 0, target=16, matchmaking_timeout=1.0, load_state_timeout=1.0)
    mb, b = make(nodes(), 0, target=16)
    try:
        assert a.wait_for_peers(2, timeout=30) == 2 and b.wait_for_peers(2, timeout=30) == 2
        gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
        trainers = [threading.Thread(target=train, args=(ma, a, gens[0], 2)),
                    threading.Thread(target=train, args=(mb, b, gens[1], 2))]
        for t in trainers:
            t.start()
        for t in trainers:
            t.join(60)
        assert a.epoch == b.epoch == 2
        train(ma, a, gens[0], 3)  # a ends the run; b, stalled, is one epoch behind
        assert a.epoch == 3 and b.epoch == 2
        assert a.drain(timeout=1.0) is False  # (b reports epoch 2)
        drained: list[bool] = []
        drainer = threading.Thread(target=lambda: drained.append(a.drain(timeout=30)))
        drainer.start()
        step(mb, b, gens[1])
        drainer.join(40)
        assert drained == [True] and b.epoch == 3 and b.stats.state_loads == 1
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    finally:
        a.close()
        b.close()


def train(model: torch.nn.Module, opt: DecentralizedOptimizer, gen: torch.Generator, until: int) -> None:
    deadline = time.monotonic() + 60
    while opt.epoch < until and time.monotonic() < deadline:
        step(model, opt, gen)


def test_a_round_that_fails_for_every_peer_is_skipped_by_all_alike(nodes):
    """Every peer missed the round: nobody holds its update, so nobody waits to load it (going back
    to the epoch before, each found that round over and missed it again, for good)."""
    peers = [make(nodes(), 0, target=32) for _ in range(2)]
    for _, opt in peers:
        real = opt.averager.step

        async def fail_first(*args, _real=real, _failed=[], **kw):
            result = await _real(*args, **kw)
            if kw.get("round_id") == "e0" and not _failed:  # (its group is over: the round cannot be had again)
                _failed.append(True)
                raise RuntimeError("the round failed")
            return result

        opt.averager.step = fail_first
    try:
        assert all(o.wait_for_peers(2, timeout=30) == 2 for _, o in peers)
        threads = [threading.Thread(target=lambda m=m, o=o, i=i: [step(m, o, torch.Generator().manual_seed(i))
                                                                  for _ in iter(lambda: o.epoch < 4, False)])
                   for i, (m, o) in enumerate(peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert all(o.epoch >= 4 for _, o in peers), [o.epoch for _, o in peers]
        assert all(o.stats.failed_rounds >= 1 for _, o in peers)
        assert all(torch.equal(a, b) for a, b in zip(peers[0][1].params, peers[1][1].params)), \
            [(o.epoch, o._applied, o.stats.state_loads, o.stats.failed_rounds, o.stats.rounds) for _, o in peers]
    finally:
        for _, o in peers:
            o.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swarm_run_again_with_more_epochs_resumes_together_and_ends_as_one(tmp_path, child_pids):
    before = child_pids()

    def swarm(epochs: int) -> tuple[list[dict], list[dict]]:
        argv = [sys.executable, "-m", "p2ptrain", "swarm", "--json", "--peers", "3", "--epochs", str(epochs),
                "--checkpoint-every", "4", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path / "data"), "-v"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        return ([e for e in events if e["event"] == "started"], [e for e in events if e["event"] == "done"])

    _, done = swarm(8)
    assert len(done) == 3 and len({e["params_digest"] for e in done}) == 1, done
    started, done = swarm(16)
    assert [(e["epoch"], e["resumed_epoch"], e["state_loads"]) for e in started] == [(8, 8, 0)] * 3, started
    assert len({e["params_digest"] for e in started}) == 1
    assert len(done) == 3 and {e["epoch"] for e in done} == {16}, done
    logs = {i: (tmp_path / "out" / "logs" / f"peer-{i}.log").read_text()[-3000:] for i in range(3)}
    assert len({e["params_digest"] for e in done}) == 1, ([(e["peer"], e["state_loads"], e["failed_rounds"],
                                                           e["group_size"]) for e in done], logs)
    assert child_pids() <= before
