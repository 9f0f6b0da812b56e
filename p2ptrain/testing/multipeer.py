"""Many training peers in one process, each with its own DHT node and identity: for benchmarks of
large swarms on few cores (``benchmarks/scale.py``).

``python -m p2ptrain.testing.multipeer '<json config>'`` runs ``count`` digits peers numbered from
``first`` (of ``world``), joined through ``bootstrap``. Each trains in its own thread with steps
that take ``step_s`` (the real forward and backward, then a sleep: emulated compute, the same for
every peer whatever the swarm's size) until its optimizer reaches ``epochs``; after each epoch it
writes its parameters (raw float32) to ``{out}/e{epoch}/p{index}.f32``. A peer done stays (serving
its state) while another still reports an earlier epoch: one that missed the last round loads the
state then, instead of training that epoch's whole target alone. At the end it prints one JSON
line per peer: samples, training seconds (and how many of them went to compute, to steps that did
not end an epoch, and to those that did; when and with how many samples the first epoch ended),
its rounds (epoch, matchmaking s, group size, cell, wall time it came, the whole matchmaking's s: more
than the first when it began early), its test accuracy, the
process's CPU seconds per peer, and those spent while its peers trained (from the last one's join
to the last one's end of training). Logs go to stderr; the child dies with its parent.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from .. import DHT, DecentralizedOptimizer
from ..averaging import StepResult
from ..children import die_with_parent
from ..optim.progress import SwarmView
from ..tasks import get_task


class TimedOptimizer(DecentralizedOptimizer):
    """Records each gradient round's matchmaking time and group size."""

    rounds: list[tuple[int, float, int, str, float, float, dict[str, Any]]]

    def _average(self, epoch: int, samples: int, view: SwarmView) -> Future[StepResult | None]:
        entered = time.time()  # (wall clock: peers in other processes arrive at the same cell)
        future = super()._average(epoch, samples, view)
        key = self._cell.key

        def done(f: Future[StepResult | None]) -> None:
            result = None if f.cancelled() or f.exception() is not None else f.result()
            if result is not None:
                st = self.averager.matchmaker.last_stats  # (this round's: a peer's rounds run one at a time)
                phases = {k: st[k] for k in ("started", "marks", "dht_latency") if k in st}
                self.rounds.append((epoch, result.matchmaking_s, result.group_size, key, entered, result.group_s,
                                    phases))

        future.add_done_callback(done)
        return future


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run_peer(index: int, cfg: dict[str, Any], dht: DHT, report: dict[str, Any]) -> None:
    task = get_task("digits", hidden=cfg["hidden"], depth=1)
    model = task.make_model(seed=0)
    world, bs, mode = cfg["world"], cfg["batch_size"], cfg["mode"]
    opt = TimedOptimizer(
        task.make_optimizer(model.parameters(), lr=cfg["lr"]), dht=dht, run_id=cfg["run_id"], mode=mode,
        target_batch_size=cfg["steps_per_epoch"] * bs * world, batch_size_per_step=bs,
        local_steps=cfg["steps_per_epoch"], target_group_size=cfg["group"], mixing=cfg["mixing"],
        matchmaking_timeout=cfg["matchmaking_timeout"], receipts=False,
        overlap_outer=cfg.get("overlap_outer", False) and mode == "diloco",
        delay_updates=cfg.get("delay_updates", False) and mode == "sync",
    )
    opt.rounds = []
    out = Path(cfg["out"])
    try:
        report["seen"] = opt.wait_for_peers(world, timeout=cfg["join_timeout"])
        gc.freeze()  # and so do the peers' models and nodes, once joined
        report["cpu_joined"] = time.process_time()
        batches = task.batches(bs, seed=1, rank=index, world=world)
        samples, epoch, t_start = 0, 0, time.perf_counter()
        spent = {"compute_s": 0.0, "step_s": 0.0, "round_s": 0.0}  # where the training time goes
        ends: list[tuple[int, float]] = []  # each epoch-ending step: the epoch it ended, its seconds
        while opt.epoch < cfg["epochs"]:
            t0 = time.perf_counter()
            task.loss(model, next(batches)).backward()
            time.sleep(max(0.0, cfg["step_s"] - (time.perf_counter() - t0)))
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            spent["compute_s"] += t1 - t0
            spent["round_s" if opt.epoch != epoch else "step_s"] += t2 - t1
            if opt.epoch != epoch:
                ends.append((epoch, round(t2 - t1, 4)))
            samples += bs
            if opt.epoch != epoch:
                if epoch == 0:  # (the first epoch's end: where the run's steady part starts)
                    spent["first_epoch"] = [time.perf_counter() - t_start, samples]
                epoch = opt.epoch
                folder = out / f"e{epoch}"
                folder.mkdir(parents=True, exist_ok=True)
                flat(model).numpy().tofile(folder / f"p{index}.f32")
        report.update(spent, samples=samples, train_s=time.perf_counter() - t_start, rounds=opt.rounds, ends=ends,
                      state_loads=opt.stats.state_loads, cpu_trained=time.process_time())
        opt.finish_round()
        opt.drain(timeout=cfg.get("linger_s", 60.0))  # (stragglers load our state before we leave)
        report["accuracy"] = task.evaluate(model)["accuracy"]
    finally:
        opt.close()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent()
    torch.set_num_threads(1)
    gc.freeze()  # (as the CLI does) the imports' heap stays out of every full collection
    dhts = [DHT(cfg["bootstrap"], listen=("127.0.0.1", 0), swarm_key=False) for _ in range(cfg["count"])]
    reports: list[dict[str, Any]] = [{"peer": cfg["first"] + i} for i in range(cfg["count"])]
    threads = [threading.Thread(target=run_peer, args=(cfg["first"] + i, cfg, dhts[i], reports[i]))
               for i in range(cfg["count"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = time.process_time() / len(reports)  # (every thread of the process: its peers' share)
    joined = max(r.pop("cpu_joined", 0.0) for r in reports)
    trained = max(r.pop("cpu_trained", 0.0) for r in reports)
    for r in reports:
        print(json.dumps({**r, "cpu_s": cpu, "train_cpu_s": max(0.0, trained - joined) / len(reports)}), flush=True)
    for d in dhts:
        d.close()


if __name__ == "__main__":
    main()
