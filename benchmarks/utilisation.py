"""Swarm utilisation: samples/s of N peers (real processes) against N x one peer alone, same run.

    python benchmarks/utilisation.py                       # 4 peers, 50 ms steps: sync, sync --delay-updates, diloco
    python benchmarks/utilisation.py --modes sync --epochs 20 --target-batch-size 4096
    python benchmarks/utilisation.py --peers 8 --modes diloco diloco-overlap --netem 100mbit,25ms  # WAN, 50 ms RTT

Every peer is ``p2ptrain peer --json --example digits --compute-delay D --wait-peers N`` (the CLI path,
through ``benchmarks/_peer_instr.py``, which only adds timing lines: when each peer's epoch changed,
its sample and CPU counters then, and the detail of every averaging round). The emulated compute is a
sleep, so N processes on a 2-core box are not CPU-bound by it; what they do burn is reported (CPU %).

Baseline: one peer alone (no one to average with, so no rounds) with the same delay and batch, run
before and after the swarms; the ratio uses their mean. A plain torch loop (forward, backward,
sleep, AdamW step; no p2ptrain) is printed for scale.

Swarm samples/s: from the peers' own counters over a steady-state window, from the moment each peer
entered epoch ``--skip`` (default 1: the first epoch, start-up included, is over) to the moment it
entered the last epoch: the sum over peers of (samples processed in the window / its length).

``--netem RATE[,DELAY[,LOSS]]`` (root only; e.g. ``--netem 100mbit,50ms``) runs each swarm peer in a
network namespace of its own (:class:`p2ptrain.testing.Testbed`), behind a link shaped to RATE both
ways with DELAY one way (so DELAY x 2 of RTT between two peers): what a swarm across the internet
pays per round (matchmaking and all-reduce round trips) shows in the per-round figures; the table's
``last mm/RTT`` is the matchmaking of each round's last peer to arrive (nobody left to wait for) in RTTs. The lone
baseline has no network to shape and runs as it does without the option.

Targets (issue): sync >= 90% of N x baseline, diloco >= 95%. ``diloco-overlap`` is diloco with
``--overlap-outer`` (each outer round runs during the next inner phase). For each mode the table decomposes the
loss: compute efficiency (a peer's samples/s while outside ``step()`` pauses vs the baseline; CPU
contention shows here) and the pause fraction (time spent inside ``step()`` for averaging), then
per-round figures: matchmaking s, all-reduce s, the lag between the first and the last peer noticing
the epoch was over, samples per epoch vs the target.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, loadavg, run_main, sigterm_as_exit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "_peer_instr.py")
TARGETS = {"sync": 0.90, "sync-delay": 0.90, "diloco": 0.95, "diloco-overlap": 0.95}


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _peer_argv(mode: str, a: argparse.Namespace, target: int, epochs: int, wait: int, boot: str | None,
               seed: int, listen_ip: str | None = None) -> list[str]:
    argv = [sys.executable, PEER, "peer", "--json", "--example", "digits", "--compute-delay", str(a.compute_delay),
            "--target-batch-size", str(target), "--epochs", str(epochs), "--batch-size", str(a.batch_size),
            "--data-seed", str(seed), "--mode", "diloco" if mode.startswith("diloco") else "sync",
            "--local-steps", str(a.local_steps)]
    if mode == "sync-delay":
        argv.append("--delay-updates")
    if mode == "diloco-overlap":
        argv.append("--overlap-outer")
    argv += ["--wait-peers", str(wait)]  # 1 (a peer alone) too: a peer with no bootstrap waits for a second
    if listen_ip:
        argv += ["--listen", f"/ip4/{listen_ip}/tcp/0"]
    if boot:
        argv += ["--bootstrap", boot]
    else:
        argv += ["--bootstrap-file", os.devnull]
    return argv


def run_swarm(mode: str, n: int, a: argparse.Namespace, target: int, epochs: int, timeout: float,
              tb=None) -> dict:
    """Start n peers (peer 0 first, the others bootstrap from it); collect their events until all
    are done (or ``timeout``); return the per-peer event lists and CPU usage. With a test bed
    ``tb``, peer i runs in its host i."""
    load0 = os.getloadavg()[0]
    env = dict(os.environ)
    if a.torch_threads:
        env["OMP_NUM_THREADS"] = str(a.torch_threads)

    def spawn(kids: Children, i: int, boot: str | None) -> None:
        ip = tb.hosts[i].ip if tb is not None else None
        wrap = functools.partial(tb.exec_argv, i) if tb is not None else None
        kids.spawn(f"p{i}", _peer_argv(mode, a, target, epochs, n, boot, i, ip), env=env, wrap=wrap)

    with Children(f"util-{mode}") as kids:
        spawn(kids, 0, None)
        _, _, ev = kids.wait_for(lambda name, e: name == "p0" and e.get("event") == "started", timeout=60)
        boot = ev["multiaddrs"][0]
        for i in range(1, n):
            spawn(kids, i, boot)
        names = [f"p{i}" for i in range(n)]
        done: set[str] = set()
        t_end = time.monotonic() + timeout
        timed_out = False
        try:
            while len(done) < n:
                left = t_end - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                name, _, _ = kids.wait_for(lambda nm, e: e.get("event") in ("done", "_eof") and nm not in done,
                                           timeout=left)
                done.add(name)
        except TimeoutError:
            timed_out = True
            print(f"  {mode}: timed out after {timeout:.0f} s; stopping the peers and using what they reported",
                  flush=True)
        rcs = kids.wait_exit(names, 20)
        events = {nm: list(kids.kids[nm].events) for nm in names}
        logs = {nm: kids.kids[nm].stderr_tail(8) for nm in names}
    bad = {nm: rc for nm, rc in rcs.items() if rc not in (0,)}
    if bad:
        print(f"  {mode}: peers exited with {bad}", flush=True)
        for nm in bad:
            print(f"  --- {nm} stderr tail ---\n{logs[nm]}", flush=True)
    return {"mode": mode, "events": events, "timed_out": timed_out, "load0": load0, "load1": os.getloadavg()[0],
            "target": target}


def analyse(run: dict, skip: int, baseline_sps: float | None) -> dict:
    """Steady-state figures of one swarm run (see the module docstring)."""
    per_peer = []
    rounds: dict[int, list[dict]] = {}
    results: dict[int, list[dict]] = {}
    state_rounds: list[dict] = []
    for name, evs in run["events"].items():
        epochs = {}
        steps = {}
        for _, e in evs:
            kind = e.get("event")
            if kind == "epoch" and not e.get("init"):
                epochs.setdefault(e["epoch"], e)
            elif kind == "steps":
                steps[e["epoch"]] = e
            elif kind == "round":
                rounds.setdefault(e["epoch"], []).append(dict(e, peer=name))
            elif kind == "result":
                results.setdefault(e["epoch"], []).append(dict(e, peer=name))
            elif kind == "state_round":
                state_rounds.append(dict(e, peer=name))
        done = [e for _, e in evs if e.get("event") == "done"]
        per_peer.append({"name": name, "epochs": epochs, "steps": steps, "done": done[0] if done else None})
    # the window: [enter epoch `skip`, enter the last epoch every peer reached]
    last = min((max(p["epochs"]) if p["epochs"] else -1) for p in per_peer)
    if last <= skip:
        return {"error": f"not enough epochs (last common epoch {last}, skip {skip})"}
    sps, comp_sps, pause_frac, cpu_pct, windows = [], [], [], [], []
    for p in per_peer:
        a, b = p["epochs"][skip], p["epochs"][last]
        dt = b["t"] - a["t"]
        ds = b["samples"] - a["samples"]
        sps.append(ds / dt)
        windows.append(dt)
        cpu_pct.append(100 * (b["cpu"] - a["cpu"]) / dt)
        ins = sum(p["steps"][e]["in_step"] for e in range(skip, last) if e in p["steps"])
        outs = sum(p["steps"][e]["out_step"] for e in range(skip, last) if e in p["steps"])
        pause_frac.append(ins / dt)
        comp_sps.append(ds / outs if outs > 0 else float("nan"))
    swarm = sum(sps)
    n = len(per_peer)
    epoch_len = _med(windows) / (last - skip)
    # per round (epochs in the window)
    mm, ar, pause, spread, samples, group, failed, skipped, enter_to_avg = [], [], [], [], [], [], 0, 0, []
    to_group, group_to_done, mm_last, h_done, phases_last = [], [], [], [], []
    for e in range(skip, last):
        recs = rounds.get(e, [])
        res = results.get(e, [])
        merged = recs
        if res:  # delay-updates: results come separately; pair them by peer
            by_peer = {r["peer"]: r for r in res}
            merged = [dict(r, **by_peer.get(r["peer"], {})) for r in recs]
        if not merged:
            continue
        enters = [r["t_enter"] for r in merged]
        spread.append(max(enters) - min(enters))
        formed = [r["t_avg_start"] + r["mm"] for r in merged if "mm" in r]
        finished = [r["t_avg_done"] for r in merged if "t_avg_done" in r]
        if formed and len(merged) == n:
            to_group.append(max(formed) - min(enters))
            group_to_done.append(max(finished) - max(formed))
            latest = max(merged, key=lambda r: r["t_enter"])
            if "mm" in latest:
                mm_last.append(latest["mm"])
                phases_last.append(latest.get("mm_stats", {}).get("marks", {}))
        if run["mode"].startswith("diloco"):
            h_done.extend(r.get("local_steps_done", 0) for r in merged)
        for r in merged:
            pause.append(r.get("pause", float("nan")))
            if "mm" in r:
                mm.append(r["mm"])
                ar.append(r["ar"])
                group.append(r["group"])
                if r["group"] < n or r.get("not_averaged") or r.get("failed"):
                    failed += 1
            elif r.get("skipped"):
                skipped += 1
            if "t_avg_start" in r:
                enter_to_avg.append(r["t_avg_start"] - r["t_enter"])
        weights = [r["weight"] for r in merged if "weight" in r]
        samples.append(max(weights) if weights else sum(r["local"] for r in merged))
    target = None if run["mode"].startswith("diloco") else run["target"]
    out = {
        "mode": run["mode"], "n": n, "swarm_sps": swarm, "per_peer_sps": sps, "window_s": _med(windows),
        "epochs": (skip, last), "epoch_s": epoch_len, "compute_sps": _med(comp_sps), "pause_frac": _med(pause_frac),
        "cpu_pct": _med(cpu_pct), "mm": mm, "ar": ar, "pause": pause, "spread": spread, "samples": samples,
        "group": group, "failed": failed, "to_group": to_group, "group_to_done": group_to_done,
        "mm_last": mm_last, "phases_last": phases_last, "h_done": h_done,
        "state_s": [r["seconds"] for r in state_rounds if skip <= r["epoch"] < last], "skipped": skipped,
        "target": target, "enter_to_avg": enter_to_avg,
        "load": (run["load0"], run["load1"]), "timed_out": run["timed_out"],
        "state_loads": max((p["done"] or {}).get("state_loads", 0) for p in per_peer),
        "accuracy": [(p["done"] or {}).get("metrics", {}).get("accuracy") for p in per_peer],
        "digests": {(p["done"] or {}).get("params_digest") for p in per_peer},
    }
    if baseline_sps:
        out["ratio"] = swarm / (n * baseline_sps)
        out["compute_ratio"] = out["compute_sps"] / baseline_sps
    return out


def baseline_peer(a: argparse.Namespace) -> dict:
    """One peer alone, same delay and batch: its samples/s between entering epoch 1 and the last."""
    run = run_swarm("sync", 1, a, a.baseline_target, a.baseline_epochs, timeout=a.timeout)
    run["mode"] = "baseline"
    res = analyse(run, 1, None)
    return res


def plain_loop(a: argparse.Namespace, seconds: float) -> float:
    """A plain torch loop, no p2ptrain: forward, backward, sleep(delay), AdamW step, zero_grad."""
    import torch

    from p2ptrain.tasks import get_task

    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    task = get_task("digits")
    model = task.make_model(0)
    opt = task.make_optimizer(model.parameters())
    batches = task.batches(a.batch_size, seed=0)
    for _ in range(5):
        task.loss(model, next(batches)).backward()
        opt.step()
        opt.zero_grad()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        task.loss(model, next(batches)).backward()
        time.sleep(a.compute_delay)
        opt.step()
        opt.zero_grad()
        n += a.batch_size
    del torch
    return n / (time.perf_counter() - t0)


def _fmt_dist(xs: list[float], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    if not xs:
        return "-"
    xs = sorted(x * scale for x in xs)
    p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
    return f"{statistics.median(xs):.{digits}f} (p90 {p90:.{digits}f}, max {xs[-1]:.{digits}f}){unit}"


#: matchmaking's phases (``Matchmaker.last_stats["marks"]``), in the order a round reaches them
PHASES = ("registered", "first_read", "all_seen", "planned", "leading", "join_sent", "closed", "join_answered")


def _phases(marks: list[dict], rtt: float) -> str:
    """Median seconds (and RTTs) from a peer's start of matchmaking to each phase, over the rounds
    that reached it (how many of them, when not all)."""
    out = []
    for ph in PHASES:
        xs = [m[ph] for m in marks if ph in m]
        if xs:
            share = "" if len(xs) == len(marks) else f" [{len(xs)}/{len(marks)}]"
            in_rtt = f" = {_med(xs) / rtt:.2f} RTT" if rtt else ""
            out.append(f"{ph} {_med(xs):.3f} s{in_rtt}{share}")
    return "; ".join(out) or "-"


def report(res: dict, base: float, rtt: float = 0.0) -> None:
    m = res["mode"]
    print(f"\n[{m}] {res['n']} peers, epochs {res['epochs'][0]}..{res['epochs'][1]} "
          f"(window {res['window_s']:.1f} s, {res['epoch_s']:.2f} s per epoch), "
          f"load {res['load'][0]:.2f} -> {res['load'][1]:.2f}", flush=True)
    print(f"  swarm {res['swarm_sps']:.0f} samples/s = {res['ratio'] * 100:.1f}% of {res['n']} x {base:.0f}"
          f"  (per peer: {', '.join(f'{s:.0f}' for s in res['per_peer_sps'])})")
    print(f"  = compute efficiency {res['compute_ratio'] * 100:.1f}% (samples/s outside step() pauses: "
          f"{res['compute_sps']:.0f} vs {base:.0f} alone) x {100 * (1 - res['pause_frac']):.1f}% not paused "
          f"(time inside step(): {100 * res['pause_frac']:.1f}%); CPU per peer {res['cpu_pct']:.0f}%")
    print(f"  step() pause per round       {_fmt_dist(res['pause'])}")
    print(f"  matchmaking per round        {_fmt_dist(res['mm'])}")
    print(f"  all-reduce per round         {_fmt_dist(res['ar'])}")
    print(f"  first->last peer ending epoch {_fmt_dist(res['spread'])}")
    print(f"  first peer ending -> every group formed {_fmt_dist(res['to_group'])}; "
          f"then -> every peer's all-reduce done {_fmt_dist(res['group_to_done'])}")
    print(f"  matchmaking of the last peer to arrive (nobody left to wait for) {_fmt_dist(res['mm_last'])}")
    print(f"  its phases, median from its start: {_phases(res['phases_last'], rtt)}")
    if res["state_s"]:
        print(f"  periodic state averaging (inside step()): {len(res['state_s'])} peer-rounds, "
              f"{_fmt_dist(res['state_s'])}")
    if res["h_done"]:
        print(f"  local steps per peer per outer round: {_fmt_dist(res['h_done'], '', digits=0)}")
    if res["target"]:
        over = [s - res["target"] for s in res["samples"]]
        print(f"  samples per epoch vs target {res['target']}: {_fmt_dist(over, ' samples', digits=0)} "
              f"(median {100 * _med(over) / res['target']:+.1f}%)")
    else:
        print(f"  samples per outer round: {_fmt_dist(res['samples'], ' samples', digits=0)}")
    print(f"  group sizes {sorted(set(res['group']))}, peer-rounds short of all peers or failed: {res['failed']}, "
          f"skipped (alone): {res['skipped']}, state loads: {res['state_loads']}, "
          f"final accuracy {', '.join(f'{x:.3f}' for x in res['accuracy'] if x is not None)}, "
          f"param digests: {len(res['digests'])} distinct", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["sync", "sync-delay", "diloco"], choices=list(TARGETS))
    ap.add_argument("--compute-delay", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--target-batch-size", type=int, default=8192,
                    help="sync: samples per global epoch (default 8192: ~3.3 s epochs at 4 x ~620 samples/s)")
    ap.add_argument("--epochs", type=int, default=12, help="global epochs (sync) / outer rounds (diloco) per run")
    ap.add_argument("--local-steps", type=int, default=50, help="diloco H (default 50: ~2.6 s rounds)")
    ap.add_argument("--skip", type=int, default=1, help="epochs excluded at the start (start-up)")
    ap.add_argument("--baseline-target", type=int, default=2048, help="the lone peer's epoch size (~3.3 s alone)")
    ap.add_argument("--baseline-epochs", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for every peer and the baselines (default 1; 0: torch's default, "
                         "one per core, whose spinning workers cost ~20x the CPU of this tiny model when "
                         "4 processes share 2 cores)")
    ap.add_argument("--save", metavar="FILE", help="write every peer's raw events of every run here (JSON)")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per swarm run before it is stopped")
    ap.add_argument("--netem", metavar="RATE[,DELAY[,LOSS]]",
                    help="each swarm peer in a network namespace of its own, its link shaped to RATE both ways "
                         "with DELAY one way (e.g. 100mbit,50ms; needs root)")
    a = ap.parse_args()
    sigterm_as_exit()
    tb = None
    if a.netem:
        from p2ptrain.testing import Testbed, TestbedError

        try:
            tb = Testbed.from_netem(a.peers, a.netem)
        except TestbedError as e:
            sys.exit(f"--netem: {e}")
    try:
        _main(a, tb)
    finally:
        if tb is not None:
            tb.close()


def _main(a: argparse.Namespace, tb) -> None:
    t_start = time.monotonic()
    print(f"{loadavg()}; {a.peers} peers, digits MLP, batch {a.batch_size}, compute delay "
          f"{a.compute_delay * 1000:.0f} ms (sleep), sync target {a.target_batch_size}, diloco H={a.local_steps}, "
          f"torch threads {a.torch_threads or 'default'}"
          f"{f'; swarm peers in network namespaces: {tb.describe()}' if tb is not None else ''}",
          flush=True)
    plain = plain_loop(a, 4.0)
    print(f"plain torch loop (no p2ptrain): {plain:.0f} samples/s ({loadavg()})", flush=True)
    b0 = baseline_peer(a)
    if "error" in b0:
        sys.exit(f"baseline failed: {b0['error']}")
    print(f"baseline, one peer alone: {b0['swarm_sps']:.0f} samples/s (CPU {b0['cpu_pct']:.0f}%, "
          f"load {b0['load'][0]:.2f} -> {b0['load'][1]:.2f})", flush=True)
    runs = []
    for mode in a.modes:
        print(f"running {mode} ({loadavg()})...", flush=True)
        runs.append(run_swarm(mode, a.peers, a, a.target_batch_size, a.epochs, a.timeout, tb))
    b1 = baseline_peer(a)
    if "error" in b1:
        sys.exit(f"baseline failed: {b1['error']}")
    print(f"baseline again, one peer alone: {b1['swarm_sps']:.0f} samples/s (CPU {b1['cpu_pct']:.0f}%, "
          f"load {b1['load'][0]:.2f} -> {b1['load'][1]:.2f})", flush=True)
    base = (b0["swarm_sps"] + b1["swarm_sps"]) / 2
    if a.save:
        import json

        with open(a.save, "w") as f:
            json.dump([{k: v for k, v in r.items()} for r in runs], f)
    results = []
    for run in runs:
        res = analyse(run, a.skip, base)
        if "error" in res:
            print(f"\n[{run['mode']}] {res['error']}", flush=True)
            continue
        results.append(res)
        report(res, base, 2 * tb.delay_s if tb is not None else 0.0)
    print(f"\nbaseline {base:.0f} samples/s per peer (runs: {b0['swarm_sps']:.0f}, {b1['swarm_sps']:.0f}); "
          f"plain torch loop {plain:.0f}; {loadavg()}; total {time.monotonic() - t_start:.0f} s")
    rtt = 2 * tb.delay_s if tb is not None else 0.0  # the last peer's matchmaking in round trips
    print("\n  mode            peers  swarm sps  ideal sps  ratio   target  pass  compute eff  paused  "
          f"pause/round  mm/round  ar/round  {'last mm/RTT  ' if rtt else ''}load")
    for r in results:
        t = TARGETS[r["mode"]]
        ideal = r["n"] * base
        in_rtt = f"{_med(r['mm_last']) / rtt:11.2f}  " if rtt else ""
        print(f"  {r['mode']:<14}  {r['n']:5d}  {r['swarm_sps']:9.0f}  {ideal:9.0f}  {100 * r['ratio']:5.1f}%  "
              f"{100 * t:5.0f}%  {'yes' if r['ratio'] >= t else 'NO':>4}  {100 * r['compute_ratio']:10.1f}%  "
              f"{100 * r['pause_frac']:5.1f}%  {_med(r['pause']):10.3f}s  {_med(r['mm']):7.3f}s  "
              f"{_med(r['ar']):7.3f}s  {in_rtt}{r['load'][0]:.2f}->{r['load'][1]:.2f}")


if __name__ == "__main__":
    run_main(main)
