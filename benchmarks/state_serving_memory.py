"""Host memory of a peer serving its training state to a joiner (StateSync), now and before.

    python benchmarks/state_serving_memory.py                       # 100M floats (400 MB), this tree
    python benchmarks/state_serving_memory.py --before /tmp/old     # and a checkout of another commit

A process holds a state of ``--floats`` float32 numbers (three tensors: parameters and two
optimizer moments, as AdamW in sync mode), served by a ``StateSync``; a trainer thread changes all
of it (under the state lock, with a version bump) every ``--step-ms``. Measured, as RSS growth over
the process once its state is allocated, in units of the state's bytes:

- idle: after a few updates with no joiner;
- download: the peak while one joiner (same process, chunks verified and discarded) downloads the
  state as the trainer keeps stepping; and the joiner's seconds;
- after: once the download is over and its lease ran out, a few updates later.

``--before TREE`` runs the same measurement with ``p2ptrain`` imported from ``TREE`` (e.g. a
``git worktree`` of the commit before live serving) in the same run, and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _procs import rss_mb  # noqa: E402


def rss() -> int:
    return int(rss_mb(os.getpid()) * 2**20)


async def measure(floats: int, step_s: float) -> dict:
    import torch

    from dht import Host, Identity
    from p2ptrain.checkpoint import fetch_state
    from p2ptrain.optim.state_sync import StateSync

    try:
        from p2ptrain.checkpoint import live
        lock = live.StateLock()
        live.LEASE = 1.0  # (the default 10 s only makes "after" wait longer)
    except ImportError:  # a tree before live serving
        live, lock = None, threading.Lock()
    torch.set_num_threads(1)
    n = floats // 3
    state = {"params": torch.ones(n), "opt": {"exp_avg": torch.ones(n), "exp_avg_sq": torch.ones(n)}}
    nbytes = 3 * n * 4
    version = [0]
    base = rss()

    host, me = Host(Identity(), ("127.0.0.1", 0)), Host(Identity(), ("127.0.0.1", 0))
    await host.start()
    await me.start()
    sync = StateSync(host, "run/state", lambda: (1, state), lock, version=lambda: version[0])
    after_update = getattr(sync, "warm", None) or sync.update_size
    await sync.start()
    stop, steps = threading.Event(), [0]

    def train() -> None:
        while not stop.wait(step_s):
            with lock:
                for t in (state["params"], *state["opt"].values()):
                    t.add_(1.0)
                version[0] += 1
            after_update()
            steps[0] += 1

    peak = [0]

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], rss())

    threads = [threading.Thread(target=train, daemon=True), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    import p2ptrain

    out: dict = {"state_mb": nbytes / 1e6, "p2ptrain": os.path.dirname(p2ptrain.__file__)}
    try:
        while steps[0] < 5:
            await asyncio.sleep(step_s)
        out["idle"] = (rss() - base) / nbytes
        peak[0], first = 0, steps[0]

        async def discard(m, i, view) -> None:
            pass

        t0 = time.perf_counter()
        await fetch_state(me, "run/state", [(host.peer_id, ("127.0.0.1", host.listen_port))], timeout=300,
                          segment_bytes=4 << 20, on_chunk=discard)
        out["download_s"] = time.perf_counter() - t0
        out["updates_during"] = steps[0] - first
        out["download_peak"] = (peak[0] - base) / nbytes
        wait_until = steps[0] + max(3, int(1.5 / step_s))  # past the lease, then an update or two
        while steps[0] < wait_until:
            await asyncio.sleep(step_s)
        out["after"] = (rss() - base) / nbytes
    finally:
        stop.set()
        for t in threads:
            t.join()
        await sync.close()
        await me.close()
        await host.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floats", type=int, default=100_000_000)
    ap.add_argument("--step-ms", type=float, default=300.0)
    ap.add_argument("--before", metavar="TREE", help="also measure p2ptrain imported from this checkout")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.floats, args.step_ms / 1000))))
        return
    trees = [("before", os.path.abspath(args.before))] if args.before else []
    trees.append(("now", os.path.dirname(HERE)))
    results = {}
    for name, tree in trees:
        env = {**os.environ, "PYTHONPATH": tree}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--floats", str(args.floats),
               "--step-ms", str(args.step_ms)]
        done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{name} ({tree}) failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    mb = results["now"]["state_mb"]
    print(f"state {mb:.0f} MB (params + two moments), trainer updating all of it every {args.step_ms:.0f} ms")
    print("trees: " + ", ".join(f"{name} {r['p2ptrain']}" for name, r in results.items()))
    print("RSS growth over the process with its state, in state sizes")
    print(f"{'':8} {'idle':>6} {'download peak':>14} {'after':>6} {'download s':>11} {'updates during':>15}")
    for name, r in results.items():
        print(f"{name:8} {r['idle']:6.2f} {r['download_peak']:14.2f} {r['after']:6.2f} {r['download_s']:11.2f} "
              f"{r['updates_during']:15d}")
    if "before" in results:
        b, n = results["before"], results["now"]
        print(f"now/before: download peak {n['download_peak'] / max(b['download_peak'], 1e-9):.2f}x, "
              f"download time {n['download_s'] / b['download_s']:.2f}x")


if __name__ == "__main__":
    main()
