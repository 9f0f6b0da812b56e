"""Sync mode's global steps hold the swarm's ``target_batch_size`` samples, however fast the steps.

Two peers in one process (threads, real loopback DHT nodes) step as fast as a tiny model allows:
an epoch then lasts a few tens of milliseconds, about as long as a read of the swarm's progress.
What goes into each round is counted from the round itself (its total weight, the samples of its
members), not from what a peer believed; and the peers count each other all along, also right after
a round, when the other may still report the epoch before.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from p2ptrain import DHT, DecentralizedOptimizer

pytestmark = pytest.mark.timeout(120)

TARGET = 1024
BATCH = 32
EPOCHS = 12


@pytest.fixture
def pair():
    dhts = [DHT([])]
    opts = []
    try:
        dhts.append(DHT([str(dhts[0].multiaddrs[0])]))
        for d in dhts:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            opts.append((model, DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), dht=d,
                                                       run_id="fast-pair", target_batch_size=TARGET,
                                                       batch_size_per_step=BATCH)))
        yield opts
    finally:
        for _, opt in opts:
            opt.close()
        for d in reversed(dhts):
            d.close()


def train_fast(model: torch.nn.Module, opt: DecentralizedOptimizer, seed: int, out: dict, deadline: float) -> None:
    """No compute beyond the tiny model: record the samples of every round and the peers seen."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.arange(8, dtype=torch.float32).reshape(8, 1) / 8
    rounds = opt.stats.rounds
    while opt.epoch < EPOCHS and time.monotonic() < deadline:
        x = torch.randn(BATCH, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), x @ w).backward()
        epoch = opt.epoch
        opt.step()
        opt.zero_grad()
        out["peers"].append(opt.stats.peers)
        if opt.stats.rounds != rounds:
            rounds = opt.stats.rounds
            out["rounds"].append((epoch, opt.stats.last_group_size, opt.stats.last_round_samples))


def run_pair(pair) -> list[dict]:
    assert all(opt.wait_for_peers(2, timeout=30) == 2 for _, opt in pair)
    outs: list[dict] = [{"peers": [], "rounds": []} for _ in pair]
    deadline = time.monotonic() + 60
    threads = [threading.Thread(target=train_fast, args=(m, o, i, outs[i], deadline)) for i, (m, o) in enumerate(pair)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert all(opt.epoch == EPOCHS for _, opt in pair), [opt.epoch for _, opt in pair]
    return outs


def test_fast_steps_average_at_least_the_target(pair):
    for out in run_pair(pair):
        paired = [(e, s) for e, g, s in out["rounds"] if g == 2]
        assert len(paired) >= EPOCHS // 2, out["rounds"]  # most epochs were averaged by the pair
        short = [(e, s) for e, s in paired if s < 0.75 * TARGET]
        assert not short, f"global steps with fewer than 3/4 of {TARGET} samples (epoch, samples): {short}"


def test_both_peers_are_counted_at_every_step(pair):
    """``stats.peers`` (the metrics' ``p2ptrain_swarm_peers``) counts the peers training in the
    run, also while the other still reports the epoch that just ended."""
    for out in run_pair(pair):
        assert set(out["peers"]) == {2}, sorted(set(out["peers"]))
