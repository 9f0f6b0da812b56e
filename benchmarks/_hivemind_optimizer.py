"""Baseline: one peer of a hivemind 1.1.12 ``hivemind.Optimizer`` swarm training a p2ptrain task,
driven by ``convergence.py --hivemind-python PY`` (run with that interpreter, never imported by
p2ptrain).

Make the interpreter with ``python3 -m venv V && V/bin/pip install torch==2.13.0 hivemind==1.1.12
'numpy<2.4' scikit-learn`` (scikit-learn for the digits data). The task comes from this repository:
the repo root goes on ``sys.path`` and only ``p2ptrain.tasks`` is imported, which needs torch (and
scikit-learn for digits) but none of p2ptrain's runtime dependencies, so both sides train the
same model, data, optimizer and metrics.

Protocol with the parent: the job is one JSON argument ``{"task", "rank", "peers" (rank 0's
multiaddrs, empty for rank 0), "batch_size", "lr", "target_batch_size", "epochs", "seed",
"matchmaking_time", "averaging_timeout", "threads"}``. We print JSON lines on stdout: ``started``
(with ``maddrs``) once the DHT and the optimizer are up, then wait for "go" on stdin (the parent's
barrier, like p2ptrain's ``--wait-peers``), train until ``epochs`` global epochs (hivemind's
collaborative mode: gradients averaged every ``target_batch_size`` samples of the swarm), print
``progress`` about once a second and ``done`` with the test metrics, samples, steps, seconds and a
parameter digest. SIGTERM stops training after the current step (``done`` is still printed).
Exit code 3: hivemind is not importable.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emit(event: dict) -> None:
    print(json.dumps(event), flush=True)


def digest(model) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    job = json.loads(sys.argv[1])
    try:
        import hivemind
        import torch
    except Exception as e:  # noqa: BLE001
        emit({"event": "error", "error": f"cannot import hivemind: {e!r}"})
        sys.exit(3)
    import logging

    sys.path.insert(0, ROOT)
    from p2ptrain.tasks import get_task  # torch (+ scikit-learn for digits) only

    logging.getLogger("hivemind").setLevel(logging.WARNING)
    torch.set_num_threads(int(job.get("threads", 1)))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    rank = int(job["rank"])
    task = get_task(job["task"])
    bs, tbs, epochs = int(job["batch_size"]), int(job["target_batch_size"]), int(job["epochs"])
    lr = job.get("lr")
    model = task.make_model(seed=int(job.get("seed", 0)))
    dht = hivemind.DHT(initial_peers=job.get("peers") or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    opt = hivemind.Optimizer(
        dht=dht, run_id=f"convergence-{task.signature}", target_batch_size=tbs, batch_size_per_step=bs,
        optimizer=lambda params: task.make_optimizer(params, lr), params=model.parameters(),
        matchmaking_time=float(job.get("matchmaking_time", 1.0)),
        averaging_timeout=float(job.get("averaging_timeout", 30.0)),
        load_state_timeout=60.0, use_local_updates=False, verbose=False,
        # hivemind warns (possible matchmaking deadlocks) unless request_timeout < matchmaking_time
        averager_opts={"request_timeout": min(3.0, float(job.get("matchmaking_time", 1.0)) / 2)},
    )
    state_loads = 0
    original_load = opt.load_state_from_peers

    def counting_load(**kwargs):
        nonlocal state_loads
        state_loads += 1
        return original_load(**kwargs)

    opt.load_state_from_peers = counting_load
    try:
        emit({"event": "started", "rank": rank, "maddrs": [str(a) for a in dht.get_visible_maddrs()]})
        sys.stdin.readline()  # "go"
        batches = task.batches(bs, seed=1000 + rank)
        t0 = time.perf_counter()
        next_report = t0 + 1.0
        steps = samples = 0
        loss_ewma = math.nan
        start_epoch = opt.local_epoch
        model.train()
        while opt.local_epoch < epochs and not stop.is_set():
            x, y = next(batches)
            loss = task.loss(model, (x, y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            samples += len(y)
            value = float(loss.detach())
            loss_ewma = value if math.isnan(loss_ewma) else 0.95 * loss_ewma + 0.05 * value
            now = time.perf_counter()
            if now >= next_report:
                next_report = now + 1.0
                emit({"event": "progress", "epoch": opt.local_epoch, "steps": steps, "samples": samples,
                      "seconds": round(now - t0, 3), "loss": round(loss_ewma, 5), "state_loads": state_loads})
        elapsed = time.perf_counter() - t0
        model.eval()
        emit({"event": "done", "epoch": opt.local_epoch, "epochs_trained": opt.local_epoch - start_epoch,
              "steps": steps, "samples": samples, "seconds": round(elapsed, 3),
              "loss": None if math.isnan(loss_ewma) else round(loss_ewma, 5), "state_loads": state_loads,
              "stopped": stop.is_set(), "metrics": task.evaluate(model), "params_digest": digest(model)})
    finally:
        opt.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
