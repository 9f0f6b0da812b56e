"""FSDP peers from the command line (``p2ptrain swarm --nproc-per-node 2 --fsdp``: two ``p2ptrain
peer`` torchrun jobs, gloo on the CPU, sync mode): every rank averages its shard with the same rank
of the other peer, the ranks of a peer end their epochs and stop together, and the shards end alike
across peers."""

from __future__ import annotations

import os
import sys

import pytest

from p2ptrain.testing.events import EventProcess

pytestmark = pytest.mark.timeout(120)


def test_two_fsdp_peers_of_two_ranks_train_and_their_shards_end_alike(tmp_path):
    epochs = 12
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    swarm = EventProcess([sys.executable, "-m", "p2ptrain", "swarm", "--json", "--peers", "2", "--nproc-per-node", "2",
                          "--fsdp", "--epochs", str(epochs), "--target-batch-size", "256", "--out", str(tmp_path)],
                         env=env)
    try:
        summary = swarm.wait_for(lambda e: e["event"] == "summary", 100)
        assert swarm.proc.wait(timeout=30) == 0, "".join(swarm.stderr)[-3000:]
    finally:
        swarm.kill()
    ends = {(e["peer"], e.get("rank", 0)): e for e in swarm.seen if e["event"] == "done"}
    assert sorted(ends) == [(0, 0), (0, 1), (1, 0), (1, 1)] and summary["same_parameters"], (sorted(ends), summary)
    started = [e for e in swarm.seen if e["event"] == "started"]
    assert [e["ranks"] for e in started] == [2, 2], started
    # each rank's shard is the same on both peers (and the two ranks' shards are different tensors)
    for r in range(2):
        assert ends[0, r]["params_digest"] == ends[1, r]["params_digest"], ends
    assert ends[0, 0]["params_digest"] != ends[0, 1]["params_digest"]
    # every rank of both peers reached the last epoch, and the model learned (one model: FSDP
    # evaluates the whole model from the shards, on every rank alike)
    assert all(e["epoch"] == epochs for e in ends.values()), ends
    accuracy = {e["metrics"]["accuracy"] for e in ends.values()}
    assert len(accuracy) == 1 and min(accuracy) > 0.6, accuracy
    assert all(ends[p, 0]["rounds"] >= epochs // 2 and ends[p, 0]["peers"] == 2 for p in range(2)), ends
