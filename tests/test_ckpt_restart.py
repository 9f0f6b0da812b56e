"""A whole swarm restarted from zero processes resumes at its last checkpoint.

Two ``p2ptrain peer`` processes train with ``--checkpoint-every``, each with its own data
directory; once both have written a checkpoint every process (the DHT included: the first peer is
the bootstrap) is SIGKILLed. A new swarm -- new processes, new identities, the same data
directories -- must start at the newest saved epoch with exactly the saved parameters, and train on.
Events come from each peer's JSON lines; every wait is bounded; every process is killed at the end.
"""

from __future__ import annotations

import hashlib

import pytest

from p2ptrain.checkpoint import restore
from p2ptrain.checkpoint.store import CheckpointStore

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

EVERY = 4


def params_digest(store: CheckpointStore, manifest_id: bytes) -> str:
    """What ``run._digest`` prints for a model holding the checkpoint's parameters."""
    state = restore(*store.load(manifest_id))
    h = hashlib.blake2b(digest_size=8)
    for p in state["params"]:
        h.update(p.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_full_swarm_restart_resumes_at_the_saved_epoch(tmp_path, peer_process):
    dirs = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    common = ("--checkpoint-every", str(EVERY), "--compute-delay", "0.02")

    def peer(*args: str):
        return peer_process("--threads", "1", *args)

    # ---- the first swarm trains until both peers have written a checkpoint, then dies at once
    first = peer("--data-dir", dirs[0], "--data-seed", "0", "--wait-peers", "2", "--epochs", "500", *common)
    addr = first.wait_for(lambda e: e["event"] == "started", 60)["multiaddrs"][0]
    second = peer("--data-dir", dirs[1], "--bootstrap", addr, "--data-seed", "1", "--wait-peers", "2",
                  "--epochs", "500", *common)
    for p in (first, second):  # with two peers both are writers (two per checkpoint)
        p.wait_for(lambda e: e["event"] == "progress" and (e["checkpoint_epoch"] or 0) >= EVERY, 120)
    for p in (first, second):
        p.kill()
    stores = [CheckpointStore(d) for d in dirs]
    latest = [s.latest(s.list()[0].run_id) for s in stores]
    assert all(i is not None and i.epoch % EVERY == 0 and i.epoch >= EVERY for i in latest), latest
    newest = max(i.epoch for i in latest)

    # ---- a new swarm from the same data directories: new processes, new identities, new DHT
    target = str(newest + 3)
    a = peer("--data-dir", dirs[0], "--data-seed", "0", "--wait-peers", "2", "--epochs", target, *common)
    a_start = a.wait_for(lambda e: e["event"] == "started", 60)
    assert a_start["epoch"] == a_start["resumed_epoch"] == latest[0].epoch, a_start
    assert a_start["state_loads"] == 0
    assert a_start["params_digest"] == params_digest(stores[0], latest[0].manifest_id)
    b = peer("--data-dir", dirs[1], "--bootstrap", a_start["multiaddrs"][0], "--data-seed", "1",
             "--wait-peers", "2", "--epochs", target, *common)
    b_start = b.wait_for(lambda e: e["event"] == "started", 60)
    assert b_start["epoch"] == newest, b_start  # its own checkpoint, or the live peer's newer state
    if latest[1].epoch >= latest[0].epoch:
        assert b_start["resumed_epoch"] == latest[1].epoch
        assert b_start["params_digest"] == params_digest(stores[1], latest[1].manifest_id)
    else:
        assert b_start["state_loads"] == 1 and b_start["resumed_epoch"] is None
    for p, start in ((a, a_start), (b, b_start)):
        done = p.wait_for(lambda e: e["event"] == "done", 120)
        assert done["epoch"] == int(target) and done["epochs_trained"] == int(target) - start["epoch"], done
        assert p.proc.wait(timeout=30) == 0, p.errors()
