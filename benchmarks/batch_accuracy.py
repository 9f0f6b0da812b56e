"""Sync mode's samples per global step against ``target_batch_size``, at several step speeds.

    python benchmarks/batch_accuracy.py                      # 2 and 8 peers; no compute, 1 ms, 10 ms steps
    python benchmarks/batch_accuracy.py --peers 2 --delays 0 --epochs 30 --delay-updates

Every configuration runs N peers (real processes, ``--per-process`` peers each, in threads) of the
README's embedding snippet with a toy model (an 8-16-1 MLP, AdamW, batch 32, target 4096): a loop of
forward, backward, an optional ``time.sleep`` standing for compute, ``opt.step()``. Each peer prints
the result of every averaging round it took part in; a global step's samples are what really went
into it: the group's total weight (the samples its members accumulated), once per group (a split
swarm's groups count one each). Rounds in which a peer met nobody while others trained, and state
loads, are counted beside.

Printed per configuration: the median, minimum and maximum samples per global step as a fraction
of the target (the bar: median >= 0.95, minimum >= 0.75) and how long the epochs took: where an
epoch lasts about as long as a read of the swarm's progress through the DHT, it overshoots.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, loadavg, run_main, sigterm_as_exit  # noqa: E402

_lock = threading.Lock()


def _emit(obj: dict) -> None:
    with _lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------- the worker (one process, k peers)

def worker(a: argparse.Namespace) -> int:
    import torch

    from p2ptrain import DHT, DecentralizedOptimizer

    torch.set_num_threads(1)

    class Recorded(DecentralizedOptimizer):
        """Prints the outcome of every averaging round this peer starts (instrumentation only)."""

        def _average(self, epoch, samples, view):  # noqa: ANN001, ANN202
            fut = super()._average(epoch, samples, view)
            me = str(self.dht.peer_id)

            def done(f) -> None:  # noqa: ANN001
                try:
                    r = f.result()
                except BaseException as e:  # noqa: BLE001
                    _emit({"event": "round", "peer": me, "epoch": epoch, "samples": samples, "error": repr(e)})
                    return
                _emit({"event": "round", "peer": me, "epoch": epoch, "samples": samples,
                       "expected": self._last_expected, "group": r.group_size if r else 1,
                       "members": sorted(str(m) for m in r.members) if r else [me],
                       "weight": r.weight_total if r else samples, "t": time.time()})

            fut.add_done_callback(done)
            return fut

    boot = [a.bootstrap] if a.bootstrap else []
    dhts = [DHT(boot)]
    if not boot:
        boot = [str(dhts[0].multiaddrs[0])]
        _emit({"event": "addr", "addr": boot[0]})
    dhts += [DHT(boot) for _ in range(a.per_process - 1)]
    errors: list[str] = []

    def train(i: int) -> None:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            opt = Recorded(torch.optim.AdamW(model.parameters(), lr=1e-3), dht=dhts[i], run_id=a.run_id,
                           target_batch_size=a.target, batch_size_per_step=a.batch_size, mode="sync",
                           delay_updates=a.delay_updates)
            try:
                opt.wait_for_peers(a.total, timeout=60)
                gen = torch.Generator().manual_seed(1000 * a.index + i)
                w = torch.arange(8, dtype=torch.float32).reshape(8, 1) / 8
                deadline = time.monotonic() + a.seconds
                while opt.epoch < a.epochs and time.monotonic() < deadline:
                    x = torch.randn(a.batch_size, 8, generator=gen)
                    torch.nn.functional.mse_loss(model(x), x @ w).backward()
                    if a.delay > 0:
                        time.sleep(a.delay)
                    opt.step()
                    opt.zero_grad()
                _emit({"event": "done", "peer": str(dhts[i].peer_id), "epoch": opt.epoch,
                       "state_loads": opt.stats.state_loads, "samples": opt.stats.samples_total})
            finally:
                opt.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=train, args=(i,)) for i in range(a.per_process)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d in dhts:
        d.close()
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


# ---------------------------------------------------------------- the driver

def run_config(a: argparse.Namespace, n: int, delay: float) -> dict:
    per = max(1, min(a.per_process or (1 if n <= 2 else 2), n))
    counts = [per] * (n // per) + ([n % per] if n % per else [])
    run_id = f"acc-{os.getpid()}-{n}-{int(delay * 1e4)}-{int(time.time())}"
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--run-id", run_id, "--total", str(n),
            "--target", str(a.target), "--batch-size", str(a.batch_size), "--delay", str(delay),
            "--epochs", str(a.epochs), "--seconds", str(a.timeout)]
    if a.delay_updates:
        base.append("--delay-updates")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rounds: list[dict] = []
    done: list[dict] = []
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with Children("batch-acc") as kids:
        kids.spawn("w0", base + ["--index", "0", "--per-process", str(counts[0])], env=env)
        _, _, ev = kids.wait_for(lambda name, e: e.get("event") == "addr", timeout=60)
        for j, k in enumerate(counts[1:], 1):
            kids.spawn(f"w{j}", base + ["--index", str(j), "--per-process", str(k), "--bootstrap", ev["addr"]],
                       env=env)
        names = list(kids.kids)
        eofs: set[str] = set()
        try:
            while len(eofs) < len(names):
                left = a.timeout + 60 - (time.monotonic() - t0)
                name, _, _ = kids.wait_for(lambda nm, e: e.get("event") == "_eof" and nm not in eofs,
                                           timeout=max(left, 1))
                eofs.add(name)
        except TimeoutError:
            print(f"  {n} peers, {delay * 1000:g} ms: timed out; using what the peers reported", flush=True)
        rcs = kids.wait_exit(names, 20)
        for nm in names:
            for _, e in kids.kids[nm].events:
                if e.get("event") == "round":
                    rounds.append(e)
                elif e.get("event") == "done":
                    done.append(e)
        bad = {nm: rc for nm, rc in rcs.items() if rc != 0}
        for nm in bad:
            print(f"  {nm} exited with {bad[nm]}:\n{kids.kids[nm].stderr_tail(8)}", flush=True)
    return {"n": n, "delay": delay, "rounds": rounds, "done": done, "seconds": time.monotonic() - t0,
            "load": (load0, os.getloadavg()[0])}


def analyse(run: dict, target: int, skip: int) -> dict:
    """Samples per global step (one per group and epoch), from the rounds' total weights."""
    last = max((d["epoch"] for d in run["done"]), default=0)
    groups: dict[tuple[int, tuple[str, ...]], float] = {}
    alone = errors = 0
    for r in run["rounds"]:
        if not skip <= r["epoch"] < last - 1:  # the first epochs hold start-up; the last may lose leavers
            continue
        if "error" in r:
            errors += 1
        elif r["group"] < 2:
            alone += r["expected"] > 1  # others trained, it met nobody: no global step of its own
        else:
            groups[(r["epoch"], tuple(r["members"]))] = r["weight"]
    fractions = [w / target for w in groups.values()]
    return {"steps": len(fractions), "fractions": fractions, "alone": alone, "errors": errors,
            "state_loads": sum(d.get("state_loads", 0) for d in run["done"]),
            "epochs": last, "epoch_s": run["seconds"] / max(last, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.001, 0.01],
                    help="seconds of emulated compute (a sleep) per step; 0: none")
    ap.add_argument("--target", type=int, default=4096, help="target_batch_size")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=20, help="global epochs per configuration")
    ap.add_argument("--skip", type=int, default=1, help="epochs left out at the start")
    ap.add_argument("--per-process", type=int, default=0, help="peers per process (default 1 for 2 peers, else 2)")
    ap.add_argument("--delay-updates", action="store_true")
    ap.add_argument("--timeout", type=float, default=120, help="seconds of training per configuration at most")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--run-id", "--bootstrap", "--index", "--total", "--delay", "--seconds"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.index, a.total, a.delay, a.seconds = int(a.index), int(a.total), float(a.delay), float(a.seconds)
        a.per_process = a.per_process or 1
        sys.exit(worker(a))
    sigterm_as_exit()
    print(f"{loadavg()}; toy MLP, batch {a.batch_size}, target {a.target}, {a.epochs} epochs per configuration"
          f"{', delayed updates' if a.delay_updates else ''}", flush=True)
    rows = []
    for n in a.peers:
        for delay in a.delays:
            run = run_config(a, n, delay)
            res = analyse(run, a.target, a.skip)
            rows.append((n, delay, run, res))
            f = sorted(res["fractions"])
            desc = (f"median {statistics.median(f):.3f}, min {f[0]:.3f}, max {f[-1]:.3f}" if f else "no global steps")
            print(f"  {n} peers, {delay * 1000:g} ms steps: {res['steps']} global steps, samples/target {desc}; "
                  f"met nobody {res['alone']}, failed {res['errors']}, state loads {res['state_loads']}; "
                  f"{res['epochs']} epochs in {run['seconds']:.1f} s, load {run['load'][0]:.2f}->{run['load'][1]:.2f}",
                  flush=True)
    print(f"\n  peers  step ms  steps  median  min     max     pass (median >= 0.95, min >= 0.75)   ({loadavg()})")
    for n, delay, _, res in rows:
        f = sorted(res["fractions"])
        if not f:
            print(f"  {n:5d}  {delay * 1000:7g}  {0:5d}  -")
            continue
        ok = statistics.median(f) >= 0.95 and f[0] >= 0.75
        print(f"  {n:5d}  {delay * 1000:7g}  {len(f):5d}  {statistics.median(f):.3f}   {f[0]:.3f}   {f[-1]:.3f}   "
              f"{'yes' if ok else 'NO'}")


if __name__ == "__main__":
    run_main(main)
