"""Late join: how soon a peer joining a swarm that trains a 256 MB model takes its first step.

    python benchmarks/late_join.py                    # 3 providers, 64M float32 params, 3 joins
    python benchmarks/late_join.py --trials 1 --width 2048   # 16M params, quicker

Three peers (processes, ``benchmarks/_late_peer.py``) train a synthetic model in ``sync`` mode: 4
bias-free Linear(4096, 4096) layers = 2**26 float32 parameters = 256 MiB, plain SGD without
momentum (the shared state is the parameters plus an empty inner state), 50 ms emulated compute
per step, fixed synthetic gradients, target batch 3072 (epochs of a few seconds: ~1000 samples/s
from 3 peers plus a 256 MiB all-reduce per epoch). Once they are past epoch 2, a fourth peer starts;
it downloads the swarm's state in its DecentralizedOptimizer constructor (from up to 4 peers at
once, each chunk verified). Measured in the joiner:

- construction start -> construction return (= its first training step can start: the target,
  2 s on loopback), -> first ``step()`` call (after one emulated compute), -> first ``step()`` return;
- inside: DHT progress read, state fetch (per provider: chunks delivered), applying the state;
- providers that contributed, and the check that the joiner's state is byte-identical to what
  the providers served (a snapshot of the joiner's own state has the downloaded manifest id,
  which is the id the providers report for that epoch).

Each joiner stays for ``--stay`` epochs, then leaves (the next trial starts a fresh one). At the end
all peers train to a common epoch and compare parameter digests. Baseline, same run: one raw
loopback TCP stream (asyncio, 1 MiB writes, two processes) moving the same number of bytes, and the
single-core cost of copying and blake3-hashing them (what a provider's snapshot costs at least).
RSS of every process is sampled throughout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, loadavg, rss_mb, run_main, sigterm_as_exit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "_late_peer.py")
TARGET_S = 2.0
MiB = 1 << 20


def raw_tcp_seconds(nbytes: int, repeats: int) -> list[float]:
    """Seconds to move ``nbytes`` over one loopback TCP stream (allreduce_bench's baseline)."""
    from allreduce_bench import raw_tcp

    return [nbytes / raw_tcp(nbytes) for _ in range(repeats)]


def copy_hash_seconds(nbytes: int) -> tuple[float, float]:
    import blake3
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    t1 = time.perf_counter()
    view = dst.numpy().view("uint8")
    chunk = 4 * MiB
    for a in range(0, len(view), chunk):
        blake3.blake3(view[a:a + chunk]).digest()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


class RssSampler:
    def __init__(self, kids: Children, period: float = 0.2):
        self.kids = kids
        self.period = period
        self.max: dict[str, float] = {}
        self.max_total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            total = 0.0
            for name, c in list(self.kids.kids.items()):
                r = rss_mb(c.pid)
                total += r
                self.max[name] = max(self.max.get(name, 0.0), r)
            self.max_total = max(self.max_total, total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def peer_argv(a: argparse.Namespace, rank: int, boot: str | None, join: bool, wait: int = 0) -> list[str]:
    argv = [sys.executable, PEER, "--rank", str(rank), "--layers", str(a.layers), "--width", str(a.width),
            "--target-batch-size", str(a.target_batch_size), "--compute-delay", str(a.compute_delay)]
    if boot:
        argv += ["--bootstrap", boot]
    if join:
        argv.append("--join")
    if wait:
        argv += ["--wait-peers", str(wait)]
    if a.log:
        argv += ["--log", a.log]
    return argv


def epoch_of(kids: Children, names: list[str]) -> int:
    best = 0
    for n in names:
        for _, e in kids.kids[n].events:
            if e.get("event") in ("epoch", "started"):
                best = max(best, e["epoch"])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--target-batch-size", type=int, default=3072)
    ap.add_argument("--compute-delay", type=float, default=0.05)
    ap.add_argument("--trials", type=int, default=3, help="joiners, one after the other")
    ap.add_argument("--stay", type=int, default=2, help="epochs each joiner trains before leaving")
    ap.add_argument("--warm-epochs", type=int, default=2, help="epochs the providers train before the first join")
    ap.add_argument("--tcp-repeats", type=int, default=3)
    ap.add_argument("--log", help="log level for the peers' p2ptrain/dht loggers (their stderr, kept in a temp dir)")
    ap.add_argument("--save", metavar="FILE", help="write every process's events here (JSON)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for the whole swarm part")
    a = ap.parse_args()
    sigterm_as_exit()
    numel = a.layers * a.width * a.width
    nbytes = numel * 4
    t_all = time.monotonic()
    print(f"{loadavg()}; model {a.layers} x Linear({a.width}, {a.width}) = {numel / 1e6:.1f}M float32 = "
          f"{nbytes / MiB:.0f} MiB; {a.providers} providers, sync mode, SGD (no momentum), compute delay "
          f"{a.compute_delay * 1000:.0f} ms, target batch {a.target_batch_size}", flush=True)
    tcp = raw_tcp_seconds(nbytes, a.tcp_repeats)
    tcp_s = statistics.median(tcp)
    print(f"baseline: raw loopback TCP, one stream, {nbytes / MiB:.0f} MiB: {tcp_s:.3f} s "
          f"({nbytes / tcp_s / 1e9:.2f} GB/s; runs {', '.join(f'{x:.3f}' for x in tcp)}) ({loadavg()})", flush=True)
    cp_s, h_s = copy_hash_seconds(nbytes)
    print(f"baseline: one core copies {nbytes / MiB:.0f} MiB in {cp_s:.3f} s, blake3 (4 MiB chunks) in {h_s:.3f} s",
          flush=True)

    joins: list[dict] = []
    served: list[dict] = []
    digests: dict[str, dict] = {}
    histories: dict[str, list[dict]] = {}  # the last epochs of each peer (printed when digests differ)
    deadline = time.monotonic() + a.timeout
    with Children("late-join", grace=15, keep_logs=True) as kids:
        print(f"peer logs: {kids.logdir}", flush=True)
        rss = RssSampler(kids)
        try:
            prov = [f"p{i}" for i in range(a.providers)]
            kids.spawn("p0", peer_argv(a, 0, None, False, a.providers), stdin=True)
            _, _, ev = kids.wait_for(lambda n, e: n == "p0" and e.get("event") == "started", timeout=120)
            boot = ev["multiaddrs"][0]
            for i in range(1, a.providers):
                kids.spawn(f"p{i}", peer_argv(a, i, boot, False, a.providers), stdin=True)
            kids.wait_for(lambda n, e: e.get("event") == "epoch" and e["epoch"] >= a.warm_epochs,
                          timeout=max(1.0, deadline - time.monotonic()))
            rss_before = {n: rss_mb(kids.kids[n].pid) for n in prov}
            print(f"providers at epoch {epoch_of(kids, prov)}; RSS {', '.join(f'{v:.0f}' for v in rss_before.values())}"
                  f" MB ({loadavg()})", flush=True)
            active = list(prov)
            for trial in range(a.trials):
                name = f"j{trial}"
                e0 = epoch_of(kids, prov)
                kids.spawn(name, peer_argv(a, a.providers + trial, boot, True), stdin=True)
                _, t_j, jev = kids.wait_for(lambda n, e, nm=name: n == nm and e.get("event") == "joined",
                                            timeout=max(1.0, deadline - time.monotonic()))
                jev["trial"], jev["swarm_epoch_at_spawn"] = trial, e0
                joins.append(jev)
                tl = jev["timeline"]
                print(f"join {trial}: loaded epoch {jev['loaded_epoch']}, construction {tl['ctor']:.3f} s, "
                      f"first step() returned after {tl['to_step_return']:.3f} s ({loadavg()})", flush=True)
                active.append(name)
                if trial == a.trials - 1:
                    break
                target = jev["epoch_after_first_step"] + a.stay
                kids.wait_for(lambda n, e, nm=name, tg=target: n == nm and e.get("event") == "epoch"
                              and e["epoch"] >= tg, timeout=max(1.0, deadline - time.monotonic()))
                kids.send(name, "quit")
                kids.wait_exit([name], 30)
                active.remove(name)
                # let the swarm forget it (its progress record expires) before the next join
                e1 = epoch_of(kids, prov)
                kids.wait_for(lambda n, e, tg=e1 + 1: n in prov and e.get("event") == "epoch" and e["epoch"] >= tg,
                              timeout=max(1.0, deadline - time.monotonic()))
            # everyone trains to a common epoch, then compares parameters
            final = max(epoch_of(kids, active), max(j["epoch_after_first_step"] for j in joins)) + 2
            for n in active:
                kids.send(n, f"finish {final}")
            left = set(active)
            while left:
                n, _, e = kids.wait_for(lambda n, e: n in left and e.get("event") in ("digest", "_eof"),
                                        timeout=max(1.0, deadline - time.monotonic()))
                left.discard(n)
                if e.get("event") == "digest":
                    digests[n] = e
                    histories[n] = [x for _, x in kids.kids[n].events if x.get("event") == "epoch"][-6:]
            rcs = kids.wait_exit(active, 30)
            for n, rc in rcs.items():
                if rc != 0:
                    print(f"  {n} exited with {rc}:\n{kids.kids[n].stderr_tail(8)}", flush=True)
        except (TimeoutError, RuntimeError) as e:
            print(f"swarm part failed: {e}", flush=True)
            for n, c in kids.kids.items():
                print(f"--- {n} stderr tail ---\n{c.stderr_tail(10)}", flush=True)
        finally:
            rss.stop()
            if a.save:
                import json

                with open(a.save, "w") as fh:
                    json.dump({n: c.events for n, c in kids.kids.items()}, fh)
            for n, c in kids.kids.items():
                served += [dict(e, peer=n) for _, e in c.events if e.get("event") == "served"]
                for _, e in c.events:
                    if e.get("event") == "epoch" and e.get("state_loads") and n.startswith("p"):
                        print(f"  note: provider {n} loaded state (epoch {e['epoch']})", flush=True)
                        break

    # ---------------------------------------------------------------- report
    print(f"\n{len(joins)} joins ({loadavg()}; total {time.monotonic() - t_all:.0f} s)")
    print("  trial  epoch  ctor->start  fetch    apply   ctor (=1st step starts)  ->step() call  ->step() return  "
          "x2s target  providers (chunks each)                 fetch/raw TCP  loads  state check")
    for j in joins:
        tl = j["timeline"]
        f = j["fetches"][0] if j["fetches"] else {}
        contrib = f.get("contributors", {})
        cstr = f"{len(contrib)}: " + ", ".join(f"{k}={v}" for k, v in contrib.items()) if contrib else "-"
        check = j["check"] or {}
        if "own_manifest" in check:
            same_epoch = [s for s in served if s["epoch"] == check["own_epoch"]]
            ids = {s["manifest"] for s in same_epoch}
            same = check["own_manifest"] == f.get("manifest")
            agree = ids == {check["own_manifest"]}
            cstate = (f"joiner {'==' if same else '!='} fetched ({check['own_manifest'][:10]} vs "
                      f"{str(f.get('manifest'))[:10]}); providers at epoch {check['own_epoch']}: "
                      f"{len(same_epoch)} snapshots, {len(ids)} distinct id"
                      + ("" if agree else " (the PROVIDERS DISAGREE: the swarm had diverged)"))
        else:
            cstate = check.get("skipped", "-")
        fetch_s = f.get("seconds", float("nan"))
        print(f"  {j['trial']:5d}  {j['loaded_epoch']:5d}  {tl['start']:10.3f}s  {fetch_s:6.3f}s  {tl['apply']:6.3f}s  "
              f"{tl['ctor']:22.3f}s  {tl['to_step_call']:12.3f}s  {tl['to_step_return']:14.3f}s  "
              f"{tl['ctor'] / TARGET_S:9.2f}x  {cstr:<40}  {fetch_s / tcp_s:12.2f}x  {j['state_loads']:5d}  {cstate}")
        if f.get("phases"):
            ph = f["phases"]
            print(f"         fetch phases: providers' manifests (their snapshots) {ph.get('probe', 0):.3f} s, "
                  f"choose {ph.get('choose', 0):.3f} s, chunks {ph.get('download', 0):.3f} s "
                  f"({nbytes / max(ph.get('download', 0), 1e-9) / 1e9:.2f} GB/s = "
                  f"{tcp_s / max(ph.get('download', 0), 1e-9):.2f}x raw TCP); "
                  f"before the fetch {tl['ctor_to_start'] + tl['start']:.3f} s (buffers, DHT progress read)")
            if f.get("cpu"):
                c = f["cpu"]
                print(f"         joiner CPU during the fetch: user {c['user']:.3f} s, sys {c['sys']:.3f} s, "
                      f"{c['minflt']} minor page faults ({c['minflt'] * 4096 / 2**20:.0f} MiB if 4 KiB each); "
                      f"written in place (into the parameters): {j.get('in_place', 0) / 2**20:.0f} MiB")
        if f.get("dropped"):
            print(f"         dropped providers: {f['dropped']}")
        if len(j["fetches"]) > 1:
            print(f"         further state loads: {[round(x.get('seconds', 0), 3) for x in j['fetches'][1:]]} s")
    if served:
        sv = [s["seconds"] for s in served]
        bv = [s["build"] for s in served if s.get("build") is not None]
        print(f"  provider manifests on request: {len(sv)}, request -> manifest ready median "
              f"{statistics.median(sv):.3f} s (max {max(sv):.3f}); of which hashing the live state "
              f"({nbytes / MiB:.0f} MiB) median {statistics.median(bv) if bv else float('nan'):.3f} s")
        for s in served:
            print(f"    {s['peer']} epoch {s['epoch']}: request -> ready {s['seconds']:.3f} s, "
                  f"hash {s.get('build') or 0:.3f} s, "
                  f"state copies held for downloads {s.get('held', 0) / MiB:.0f} MiB, "
                  f"RSS {s.get('rss', 0):.0f} MB")
    if joins:
        ctor = [j["timeline"]["ctor"] for j in joins]
        ret = [j["timeline"]["to_step_return"] for j in joins]
        unloaded = sum(1 for j in joins if not j["fetches"] or "error" in j["fetches"][0])
        ok = statistics.median(ctor) <= TARGET_S and not unloaded
        if unloaded:
            print(f"  {unloaded} of {len(joins)} joiners did NOT load the swarm's state (see the peer logs)")
        print(f"  construction (first step can start): median {statistics.median(ctor):.3f} s = "
              f"{statistics.median(ctor) / TARGET_S:.2f}x the {TARGET_S:.0f} s target "
              f"({'PASS' if ok else 'FAIL'} at the median; {sum(c <= TARGET_S for c in ctor)} of {len(ctor)} joins "
              f"within {TARGET_S:.0f} s, max {max(ctor):.3f} s); "
              f"first step() return: median {statistics.median(ret):.3f} s; raw TCP for the same bytes {tcp_s:.3f} s; "
              f"joiner DHT start {statistics.median(j['timeline']['dht_start'] for j in joins):.3f} s (not counted)")
    if digests:
        vals = {d["digest"] for d in digests.values()}
        eps = {d["epoch"] for d in digests.values()}
        verdict = "ALL EQUAL" if len(vals) == 1 else "DIFFERENT: " + str({n: d["digest"] for n, d in digests.items()})
        print(f"  final parameters at epoch {sorted(eps)}: {len(vals)} distinct digest(s) over {len(digests)} peers "
              f"({verdict})")
        if len(vals) > 1:  # who averaged with whom, and who loaded state, in the last epochs
            for n in digests:
                hist = histories.get(n, [])
                print(f"    {n}: " + ", ".join(f"e{e['epoch']} group {e.get('group')} rounds {e.get('rounds')} "
                                           f"loads {e.get('state_loads')}" for e in hist))
    print(f"  RSS max per process (MB): {', '.join(f'{n} {v:.0f}' for n, v in rss.max.items())}; "
          f"max sum {rss.max_total / 1024:.1f} GiB")


if __name__ == "__main__":
    run_main(main)
