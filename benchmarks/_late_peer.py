"""One peer of benchmarks/late_join.py (not a public tool): a synthetic 64M-parameter model in sync mode.

    python benchmarks/_late_peer.py [--bootstrap MULTIADDR] [--join] --rank R ...

The model is ``layers`` bias-free ``Linear(width, width)`` (default 4 x 4096 x 4096 = 2**26 float32
= 256 MiB), trained by plain SGD without momentum (so the shared state is the parameters and an empty
inner state). There is no forward/backward: each step sleeps ``--compute-delay`` (the emulated
compute) and calls ``opt.step()`` with fixed synthetic gradients (set once, never zeroed; distinct
per rank, so averaging matters). JSON lines on stdout, every one with ``"t"`` = ``time.time()``:

- ``started``: multiaddrs; ``epoch``: this peer entered a new global epoch (with its state loads).
- ``served`` (providers): a state snapshot was taken for a peer that asked: its epoch, manifest id,
  seconds (copy + hash, taken while holding the optimizer's state lock).
- ``joined`` (``--join``): the join timeline (DHT start, construction, state fetch and apply, first
  step), the fetch result (contributors and chunks each, dropped providers) and the check that
  the loaded state is byte-identical to what the providers served: a snapshot of the joiner's own
  state must have the manifest id it downloaded.
- ``digest``: after ``finish E`` on stdin: blake3 of the parameters once ``opt.epoch >= E``.

stdin: ``finish E`` (train until epoch E, print the digest, leave), ``quit`` (leave now).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

_lock = threading.Lock()


def emit(obj: dict) -> None:
    obj.setdefault("t", time.time())
    with _lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap")
    ap.add_argument("--join", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--target-batch-size", type=int, default=3072)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--compute-delay", type=float, default=0.05)
    ap.add_argument("--wait-peers", type=int, default=0)
    ap.add_argument("--run-id", default="late-join-bench")
    ap.add_argument("--log", default="WARNING", help="log level of the p2ptrain/dht loggers (stderr)")
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(threadName)s %(name)s %(levelname)s: %(message)s",
                        datefmt="%H:%M:%S")
    for i, item in enumerate(a.log.split(",")):  # "INFO" or "INFO,p2ptrain.matchmaking=DEBUG"
        if "=" in item:
            name, level = item.split("=", 1)
            logging.getLogger(name).setLevel(level.upper())
        elif i == 0:
            for name in ("p2ptrain", "dht"):
                logging.getLogger(name).setLevel(item.upper())

    t_proc = time.perf_counter()
    import blake3
    import torch

    from p2ptrain import DHT
    from p2ptrain.optim import DecentralizedOptimizer
    from p2ptrain.optim import state_sync as ss

    torch.set_num_threads(1)

    # ---- observe (no behaviour change): snapshots served, fetches made
    fetches: list[dict] = []
    orig_fetch = ss.StateSync.fetch
    orig_refresh = ss.StateSync._refresh

    async def fetch(self, peers, timeout, **kwargs):
        t0 = time.perf_counter()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        rec = {"t_start": time.time(), "offered": [str(p.peer) for p in peers]}
        try:
            res = await orig_fetch(self, peers, timeout, **kwargs)
        except BaseException as e:
            rec.update(error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
            fetches.append(rec)
            raise
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        rec.update(phases=dict(phases), cpu={"user": ru1.ru_utime - ru0.ru_utime, "sys": ru1.ru_stime - ru0.ru_stime,
                                             "minflt": ru1.ru_minflt - ru0.ru_minflt})
        phases.clear()
        rec.update(seconds=time.perf_counter() - t0, fetch_seconds=res.seconds, manifest=res.manifest.id.hex(),
                   epoch=res.manifest.meta.get("epoch"), bytes=res.manifest.total_size, chunks=res.manifest.num_chunks,
                   contributors={str(k)[-8:]: v for k, v in res.contributors.items()},
                   dropped={str(k)[-8:]: v for k, v in res.dropped.items()}, corrupt=len(res.corrupt))
        fetches.append(rec)
        return res

    builds: list[float] = []  # seconds each manifest took to hash from the live tensors
    from p2ptrain.checkpoint.live import LiveSource

    orig_describe = LiveSource.describe

    def describe(self, meta):  # runs in the executor thread, taking the state lock per chunk
        t0 = time.perf_counter()
        try:
            return orig_describe(self, meta)
        finally:
            builds.append(time.perf_counter() - t0)

    LiveSource.describe = describe

    async def refresh(self):
        t0 = time.perf_counter()
        n = len(builds)
        before = self.server.latest(self.key)
        await orig_refresh(self)  # describes the live state when it changed
        m = self.server.latest(self.key)
        if m is not None and m is not before:
            emit({"event": "served", "epoch": m.meta.get("epoch"), "manifest": m.id.hex(),
                  "seconds": time.perf_counter() - t0, "build": builds[n] if len(builds) > n else None,
                  "held": self.held_bytes, "rss": rss_mb()})

    ss.StateSync.fetch = fetch

    # phases of the fetch (probe = every provider's manifest, i.e. its snapshot; download = the chunks)
    from p2ptrain.checkpoint import fetch as tr

    phases: dict[str, float] = {}

    def timed(name, fn):
        async def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(self, *args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    for _name in ("probe", "choose", "download"):
        if hasattr(tr._Fetch, _name):
            setattr(tr._Fetch, _name, timed(_name, getattr(tr._Fetch, _name)))
    ss.StateSync._refresh = refresh

    marks: dict[str, float] = {}

    class Timed(DecentralizedOptimizer):
        async def _start(self):
            marks["start0"] = time.perf_counter()
            await super()._start()
            marks["start1"] = time.perf_counter()

        def _load_state_from_peers(self, view, **kwargs):
            marks.setdefault("load0", time.perf_counter())
            ok = super()._load_state_from_peers(view, **kwargs)
            marks.setdefault("load1", time.perf_counter())
            return ok

        def _apply_shared_state(self, *args, **kwargs):
            marks.setdefault("apply0", time.perf_counter())
            super()._apply_shared_state(*args, **kwargs)
            marks.setdefault("apply1", time.perf_counter())

    # ---- commands from the benchmark
    finish_at: list[int | None] = [None]
    quit_now = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            parts = line.split()
            if parts[:1] == ["finish"]:
                finish_at[0] = int(parts[1])
            elif parts[:1] == ["quit"]:
                quit_now.set()
        quit_now.set()  # EOF: the benchmark is gone

    threading.Thread(target=read_stdin, daemon=True).start()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: quit_now.set())  # the benchmark stops us: leave cleanly

    torch.manual_seed(1234)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)])
    params = list(model.parameters())
    for p in params:  # fixed synthetic gradients, distinct per rank
        p.grad = torch.full_like(p, 1e-4 * (a.rank + 1))
    t_model = time.perf_counter()

    inner = torch.optim.SGD(params, lr=1e-2)  # built before the clock starts: the first torch optimizer
    # of a process imports torch._dynamo (~3.7 s here), a cost of the user's script, not of joining
    t_dht0 = time.perf_counter()
    dht = DHT([a.bootstrap] if a.bootstrap else [])
    t_dht1 = time.perf_counter()
    opt = None
    try:
        t_ctor0 = time.perf_counter()
        opt = Timed(inner, dht=dht, run_id=a.run_id,
                    target_batch_size=a.target_batch_size, batch_size_per_step=a.batch_size, mode="sync")
        t_ctor1 = time.perf_counter()
        in_place = opt.stats.last_state_in_place  # of the constructor's load
        emit({"event": "started", "multiaddrs": [str(m) for m in dht.multiaddrs], "epoch": opt.epoch,
              "rss": rss_mb(), "numel": sum(p.numel() for p in params)})
        if a.wait_peers > 1:
            opt.wait_for_peers(a.wait_peers)
        loaded_epoch = opt.epoch
        check = None
        steps = 0
        epoch = opt.epoch
        max_step = 0.0
        while not quit_now.is_set():
            if finish_at[0] is not None and opt.epoch >= finish_at[0]:
                break
            time.sleep(a.compute_delay)  # forward + backward
            s0 = time.perf_counter()
            opt.step()
            s1 = time.perf_counter()
            max_step = max(max_step, s1 - s0)
            steps += 1
            if steps == 1 and a.join:
                # the loaded state, byte for byte: a snapshot of ours must have the id we downloaded
                # (valid while no update was applied since: sync mode changes parameters only at an epoch end)
                if opt.epoch == loaded_epoch and opt.stats.state_loads == 1:
                    from p2ptrain.checkpoint import build_snapshot

                    c0 = time.perf_counter()
                    with opt._state_lock:
                        ep, state = opt._shared_state()
                        manifest, _ = build_snapshot(state, meta={"epoch": ep})
                    check = {"own_manifest": manifest.id.hex(), "own_epoch": ep, "seconds": time.perf_counter() - c0}
                else:
                    check = {"skipped": f"epoch {loaded_epoch} -> {opt.epoch}, state loads {opt.stats.state_loads} "
                                        "during the first step: the loaded state is not ours any more"}
                ru = resource.getrusage(resource.RUSAGE_SELF)
                emit({"event": "joined", "loaded_epoch": loaded_epoch, "epoch_after_first_step": opt.epoch,
                      "state_loads": opt.stats.state_loads, "last_state_load_s": opt.stats.last_state_load_s,
                      "in_place": in_place,
                      "timeline": {
                          "process_to_model": t_model - t_proc, "dht_start": t_dht1 - t_dht0,
                          "ctor_to_start": marks.get("start0", t_ctor0) - t_ctor0,
                          "start": marks.get("start1", 0) - marks.get("start0", 0),
                          "load": marks.get("load1", 0) - marks.get("load0", 0),
                          "apply": marks.get("apply1", 0) - marks.get("apply0", 0),
                          "ctor": t_ctor1 - t_ctor0,
                          "to_step_call": s0 - t_ctor0, "to_step_return": s1 - t_ctor0, "first_step": s1 - s0},
                      "fetches": fetches, "check": check, "rss": rss_mb(), "maxrss": ru.ru_maxrss / 1024})
            if opt.epoch != epoch:
                epoch = opt.epoch
                emit({"event": "epoch", "epoch": epoch, "state_loads": opt.stats.state_loads, "rss": rss_mb(),
                      "max_step": max_step, "rounds": opt.stats.rounds, "group": opt.stats.last_group_size,
                      "round_s": opt.stats.last_round_s})
                max_step = 0.0
        if finish_at[0] is not None and opt.epoch >= finish_at[0] and not quit_now.is_set():
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            for p in params:
                h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy())
            emit({"event": "digest", "epoch": opt.epoch, "digest": h.hexdigest()[:16],
                  "state_loads": opt.stats.state_loads})
    finally:
        if opt is not None:
            opt.close()
        dht.close()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
