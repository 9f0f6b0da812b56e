#!/usr/bin/env python3
"""Swarms of 8 to 64 training peers with mixing groups: per-peer throughput, accuracy, matchmaking
time and parameter spread as N grows.

    python benchmarks/scale.py [--n 8 16 32 64] [--modes sync diloco] [--group 4] [--per-proc 8]

Each run: N digits peers (a 64-32-10 MLP), ``--per-proc`` of them per child process
(``p2ptrain.testing.multipeer``, each peer with its own DHT node and identity), joined through one
bootstrap node in this process. Every step takes ``--step-s`` (50 ms of emulated compute, the same
per peer at every N); sync epochs take ``--steps`` steps of every peer (the target batch grows with
N), diloco rounds ``--steps`` local steps; ``target_group_size`` ``--group`` < N, so rounds meet
in mixing-grid cells. Printed per mode and N, with ratios to the first N of the run:
  * per-peer samples/s (mean over peers of samples / training seconds; target >= 0.8 at 64);
  * final test accuracy (mean and min over peers; target: N=64 within 1 point of N=8);
  * matchmaking time per gradient round (median and p90 over every peer's rounds; target <= 1.5x): the
    wait for the group from the moment a peer's epoch ended (a round's matchmaking begins before,
    see ``rounds.begin_early``: the group may be there already), and the mean group size;
    and where it goes: over how long a cell's peers (and the whole swarm) ended the epoch and began
    its round, how long matchmaking took after a cell's last peer began (in s and in DHT read
    latencies: a loaded box slows every round trip), and the whole matchmaking from its start;
  * where a peer's training time goes, per epoch: compute (forward, backward and the emulated
    rest of ``--step-s``), steps that did not end an epoch, and those that did (its round, or a
    state load); and per-peer samples/s from the first epoch's end on (without the start, when
    peers begin as each sees the whole swarm);
  * CPU seconds per peer and epoch while training (its process's CPU time from its last peer's
    join to its last peer's end of training, over its peers: flat when no peer's per-epoch work
    grows with N), and over the whole run (start and join included);
  * the parameter spread after each epoch: max distance between two peers' parameters over the
    norm of their mean (``*``: an epoch that ended with a state round).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._procs import Children, loadavg, run_main, sigterm_as_exit  # noqa: E402
from p2ptrain import DHT  # noqa: E402

STATE_EVERY = {"sync": 5, "diloco": 10}  # the optimizer's default average_state_every


def spread_of(folder: Path, verbose: bool = False) -> float:
    files = sorted(folder.glob("p*.f32"))
    flats = np.stack([np.fromfile(f, dtype=np.float32) for f in files]).astype(np.float64)
    mean_norm = np.linalg.norm(flats.mean(0))
    if verbose:
        far = np.linalg.norm(flats - np.median(flats, 0), axis=1) / mean_norm
        print(folder.name, " ".join(f"{f.stem}:{d:.1e}" for f, d in zip(files, far)), file=sys.stderr)
    sq = (flats ** 2).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * flats @ flats.T, 0.0)
    return float(np.sqrt(d2.max()) / mean_norm)


def run(mode: str, n: int, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"p2ptrain-scale-{mode}{n}-"))
    boot = DHT([], listen=("127.0.0.1", 0), swarm_key=False)
    epochs = args.epochs if args.epochs else (20 if mode == "sync" else 8)
    load0 = os.getloadavg()[0]
    try:
        with Children(tag="scale") as kids:
            procs = math.ceil(n / args.per_proc)
            for p in range(procs):
                first = p * n // procs
                cfg = {"bootstrap": [str(boot.multiaddrs[0])], "first": first, "count": (p + 1) * n // procs - first,
                       "world": n, "mode": mode, "run_id": f"scale-{mode}-{n}", "hidden": 32,
                       "batch_size": 32, "lr": args.lr or (1e-2 if mode == "sync" else 3e-3),
                       "steps_per_epoch": args.steps or (4 if mode == "sync" else 10), "group": args.group,
                       "mixing": not args.no_mixing, "matchmaking_timeout": 5.0, "join_timeout": 180.0,
                       "overlap_outer": args.overlap_outer, "delay_updates": args.delay_updates,
                       "epochs": epochs, "step_s": args.step_s, "out": str(out)}
                kids.spawn(f"p{p}", [sys.executable, "-m", "p2ptrain.testing.multipeer", json.dumps(cfg)])
            reports: list[dict] = []
            t0 = time.monotonic()
            while len(reports) < n:
                left = args.timeout - (time.monotonic() - t0)
                _, _, obj = kids.wait_for(lambda _n, e: "peer" in e, timeout=max(60.0, left))
                reports.append(obj)
        if args.dump:
            with open(args.dump, "a") as f:
                for r in reports:
                    f.write(json.dumps({"mode": mode, "n": n, "peer": r["peer"], "rounds": r["rounds"],
                                        "ends": r.get("ends", [])}) + "\n")
        if args.verbose:
            for r in sorted(reports, key=lambda r: r["peer"]):
                rounds = [(e, round(m, 2), g, k) for e, m, g, k, *_ in r["rounds"]]
                print(r["peer"], r["state_loads"], rounds, file=sys.stderr)
        sps = [r["samples"] / r["train_s"] for r in reports]
        # (from the first epoch's end on: the part a long run is made of, without the start)
        steady = [(r["samples"] - r["first_epoch"][1]) / (r["train_s"] - r["first_epoch"][0])
                  for r in reports if "first_epoch" in r and r["train_s"] > r["first_epoch"][0]]
        rounds = [x for r in reports for x in r["rounds"]]
        cells: dict[tuple[int, str], list[float]] = {}
        swarm: dict[int, list[float]] = {}
        for epoch, _, _, key, entered, *_ in rounds:
            cells.setdefault((epoch, key), []).append(entered)
            swarm.setdefault(epoch, []).append(entered)
        # the matchmaking's own time: from the moment the cell's last peer began its round (they begin
        # before their epoch's end, each by its own estimate) to our group, in s and in DHT latencies
        began: dict[tuple[int, str], list[float]] = {}
        for epoch, _, _, key, _, _, phases in rounds:
            began.setdefault((epoch, key), []).append(phases["started"])
        after = [(ph["started"] + whole - max(began[e, k]), ph.get("dht_latency") or float("nan"))
                 for e, _, _, k, _, whole, ph in rounds]
        spreads = {e: spread_of(out / f"e{e}", args.verbose) for e in range(1, epochs + 1) if (out / f"e{e}").exists()}
        return {"mode": mode, "n": n, "sps": statistics.mean(sps),
                "steady": statistics.mean(steady) if steady else float("nan"),
                "acc": statistics.mean(r["accuracy"] for r in reports), "acc_min": min(r["accuracy"] for r in reports),
                "mm": statistics.median(x[1] for x in rounds) if rounds else float("nan"),
                "mm90": float(np.percentile([x[1] for x in rounds], 90)) if rounds else float("nan"),
                "mm_whole": statistics.median(x[5] for x in rounds) if rounds else float("nan"),
                "group": statistics.mean(x[2] for x in rounds) if rounds else 0.0,
                "cell_spread": statistics.median(max(v) - min(v) for v in cells.values()) if cells else 0.0,
                "swarm_spread": statistics.median(max(v) - min(v) for v in swarm.values()) if swarm else 0.0,
                "begin_spread": statistics.median(max(v) - min(v) for v in began.values()) if began else 0.0,
                "after_last": statistics.median(a for a, _ in after) if after else float("nan"),
                "after_last90": float(np.percentile([a for a, _ in after], 90)) if after else float("nan"),
                "after_trips": statistics.median(a / lat for a, lat in after) if after else float("nan"),
                "latency": statistics.median(lat for _, lat in after) if after else float("nan"),
                "loads": sum(r["state_loads"] for r in reports), "spreads": spreads,
                **{k: statistics.mean(r.get(k, 0.0) for r in reports) / epochs
                   for k in ("compute_s", "step_s", "round_s")},
                "cpu": statistics.mean(r.get("cpu_s", 0.0) for r in reports) / epochs,
                "train_cpu": statistics.mean(r.get("train_cpu_s", 0.0) for r in reports) / epochs,
                "load": (load0, os.getloadavg()[0])}
    finally:
        boot.close()
        shutil.rmtree(out, ignore_errors=True)


def ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base >= 0.001 else "-"  # (a ratio to nothing says nothing)


def table(rows: list[dict]) -> None:
    base = rows[0]
    print(f"\n{rows[0]['mode']}: per-peer samples/s, accuracy, matchmaking per round ({loadavg()})")
    print("| N | samples/s per peer | ratio | accuracy (min) | d acc | matchmaking s (p90) | ratio | group "
          "| state loads | CPU s per peer-epoch: training (ratio), whole run | load (start-end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['sps']:.1f} | {r['sps'] / base['sps']:.2f} | {100 * r['acc']:.1f} "
              f"({100 * r['acc_min']:.1f}) | {100 * (r['acc'] - base['acc']):+.1f} | {r['mm']:.3f} ({r['mm90']:.3f}) | "
              f"{ratio(r['mm'], base['mm'])} | {r['group']:.1f} | {r['loads']} | {r['train_cpu']:.3f} "
              f"({r['train_cpu'] / max(base['train_cpu'], 1e-9):.2f}), {r['cpu']:.3f} | "
              f"{r['load'][0]:.0f}-{r['load'][1]:.0f} |")
    print("where the time goes (s): | N | a cell's peers end their epoch over | the whole swarm over "
          "| a cell's peers begin its round over (medians) | matchmaking after the cell's last began (p90; ratio) "
          "| the same in DHT read latencies (latency s) | matchmaking from its start (begun early: before the "
          "epoch's end) | per peer-epoch: compute | other steps | epoch-ending steps (rounds, state loads) "
          "| samples/s per peer after the first epoch (ratio) |")
    for r in rows:
        print(f"| {r['n']} | {r['cell_spread']:.3f} | {r['swarm_spread']:.3f} | {r['begin_spread']:.3f} "
              f"| {r['after_last']:.3f} ({r['after_last90']:.3f}; {ratio(r['after_last'], base['after_last'])}) "
              f"| {r['after_trips']:.1f} ({r['latency']:.4f}) "
              f"| {r['mm_whole']:.3f} | {r['compute_s']:.2f} | {r['step_s']:.2f} | {r['round_s']:.2f} "
              f"| {r['steady']:.1f} ({r['steady'] / base['steady']:.2f}) |")
    every = STATE_EVERY[rows[0]["mode"]]
    print("parameter spread after each epoch (* = after a state round):")
    for r in rows:
        cells = " ".join(f"{s:.1e}{'*' if e % every == 0 else ''}" for e, s in sorted(r["spreads"].items()))
        print(f"  N={r['n']}: {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--modes", nargs="+", choices=["sync", "diloco"], default=["sync", "diloco"])
    ap.add_argument("--group", type=int, default=4, help="target_group_size (default 4)")
    ap.add_argument("--per-proc", type=int, default=8, help="peers per child process")
    ap.add_argument("--step-s", type=float, default=0.05, help="emulated compute per step")
    ap.add_argument("--steps", type=int, help="steps per epoch (sync, default 4) / local steps (diloco, 10)")
    ap.add_argument("--epochs", type=int, help="epochs (sync, default 20) / rounds (diloco, 8)")
    ap.add_argument("--lr", type=float, help="AdamW lr (default: sync 1e-2, diloco 3e-3)")
    ap.add_argument("--no-mixing", action="store_true", help="baseline: fixed groups, one key per round")
    ap.add_argument("--overlap-outer", action="store_true",
                    help="diloco: the outer round runs while the next inner phase trains (overlap_outer)")
    ap.add_argument("--delay-updates", action="store_true",
                    help="sync: the round runs while the next epoch's batches are computed (delay_updates)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one N's run may take (default 900)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--dump", help="append every peer's rounds here (JSON lines: epoch, matchmaking s, group, "
                    "cell, epoch end, whole matchmaking s, its start, its phases) and epoch-ending steps' seconds")
    ap.add_argument("--verbose", action="store_true",
                    help="print every peer's rounds (epoch, matchmaking s, group, cell) and distances")
    args = ap.parse_args()
    sigterm_as_exit()
    all_rows = []
    for mode in args.modes:
        rows = []
        for n in args.n:
            print(f"{mode} N={n} ...", file=sys.stderr, flush=True)
            rows.append(run(mode, n, args))
        table(rows)
        all_rows += rows
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=1))


if __name__ == "__main__":
    run_main(main)
