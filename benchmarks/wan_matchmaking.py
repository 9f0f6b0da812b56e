"""Matchmaking round trips on WAN links: this checkout against a base commit, rounds interleaved.

    python benchmarks/wan_matchmaking.py                       # 8 hosts, 100mbit, 25 ms one way, 20 rounds each
    python benchmarks/wan_matchmaking.py --rounds 40 --spread 0.3 --base e6eb1ab
    python benchmarks/wan_matchmaking.py --late 0.8      # one peer starts every round 0.8 s after the others

Root only (network namespaces: :class:`p2ptrain.testing.Testbed`). Every host runs two matchmaking
peers (``benchmarks/_mm_worker.py``): one of this checkout's code, one of ``--base`` (its ``dht`` and
``p2ptrain`` taken with ``git archive``); each version is a swarm of its own. Rounds alternate
between the versions (which goes first alternates too), so that both meet the same load on a shared
box. In a round every peer is told to start at its own moment, spread evenly over ``--spread``
seconds in a random order (peers ending an epoch), and expects all the others (as the optimizer's
``expected``); with ``--late`` the last one comes that much later still. Printed per version, in
seconds and in RTTs: the matchmaking of the round's last peer to start (nobody left to wait for:
the figure the floor is about) and of every peer, rounds that did not form one group, and where the
last peer's time went (``Matchmaker.last_stats["marks"]``, where the code has them).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import REPO, Children, loadavg, run_main, sigterm_as_exit  # noqa: E402

WORKER = os.path.join(REPO, "benchmarks", "_mm_worker.py")
BASE = "e6eb1ab"  # the last commit whose gather waited for reads of the holders, with a fixed grace
PHASES = ("all_seen", "planned", "join_sent", "leading", "closed", "join_answered")


def _tree(commit: str, into: str) -> str:
    """``dht`` and ``p2ptrain`` as of ``commit``, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", REPO, "archive", commit, "dht", "p2ptrain"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run(a: argparse.Namespace, tb, base_tree: str) -> dict[str, list[list[dict]]]:
    """Start both swarms, run the rounds; per version, per round, the peers' reports in start order."""
    versions = {"base": base_tree, "this": ""}
    rounds: dict[str, list[list[dict]]] = {v: [] for v in versions}
    rng = random.Random(a.seed)
    with Children("wan-mm") as kids:
        for v, tree in versions.items():
            boot = ""
            for i in range(a.peers):
                argv = [sys.executable, WORKER, "--listen", tb.hosts[i].ip, "--expected", str(a.peers),
                        "--timeout", str(a.timeout), *(["--tree", tree] if tree else []),
                        *(["--bootstrap", boot] if boot else [])]
                kids.spawn(f"{v}{i}", argv, stdin=True, wrap=lambda argv, i=i: tb.exec_argv(i, argv))
                if i == 0:
                    _, _, ev = kids.wait_for(lambda nm, e, v=v: nm == f"{v}0" and e.get("event") == "ready", 90)
                    boot = ev["addr"]
            ready = {f"{v}0"}
            while len(ready) < a.peers:
                nm, _, _ = kids.wait_for(lambda nm, e, v=v: nm.startswith(v) and e.get("event") == "ready", 90)
                ready.add(nm)
        time.sleep(2.0)  # (routing tables fill in)
        for k in range(a.rounds):
            for v in (list(versions) if k % 2 == 0 else list(reversed(versions))):
                order = list(range(a.peers))
                rng.shuffle(order)
                t0 = time.monotonic()
                for j, i in enumerate(order):
                    late = a.late if j == a.peers - 1 else 0.0
                    time.sleep(max(0.0, t0 + a.spread * j / max(1, a.peers - 1) + late - time.monotonic()))
                    kids.send(f"{v}{i}", "go")
                got: dict[str, dict] = {}
                while len(got) < a.peers:
                    nm, _, ev = kids.wait_for(lambda nm, e, v=v: nm.startswith(v) and e.get("event") == "round",
                                              a.timeout + 10)
                    got[nm] = ev
                rounds[v].append([got[f"{v}{i}"] for i in order])
                time.sleep(a.gap)
    return rounds


def report(rounds: dict[str, list[list[dict]]], rtt: float) -> None:
    medians = {}
    print(f"\n  {'':6} last peer: median s (RTT), p90 s (RTT)    every peer: median s (RTT)  rounds  split")
    for v, rs in rounds.items():
        last = [r[-1]["seconds"] for r in rs]
        every = [p["seconds"] for r in rs for p in r]
        split = sum(1 for r in rs if len({p["group"] for p in r}) > 1)
        medians[v] = statistics.median(last)
        print(f"  {v:6} {medians[v]:.3f} ({medians[v] / rtt:.2f}), {_p(last, 0.9):.3f} ({_p(last, 0.9) / rtt:.2f})"
              f"{statistics.median(every):22.3f} ({statistics.median(every) / rtt:.2f}){len(rs):8d}{split:7d}")
    print(f"  ratio this / base, last peer's median: {medians['this'] / medians['base']:.2f}")
    for v, rs in rounds.items():
        marks = [r[-1]["marks"] for r in rs if r[-1].get("marks")]
        parts = []
        for ph in PHASES:
            xs = [m[ph] for m in marks if ph in m]
            if xs:
                share = "" if len(xs) == len(marks) else f" [{len(xs)}/{len(marks)}]"
                parts.append(f"{ph} {statistics.median(xs) / rtt:.2f}{share}")
        if parts:
            print(f"  {v}: the last peer's phases, median RTTs from its start: {'; '.join(parts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--netem", default="100mbit,25ms", help="each host's link: RATE[,DELAY[,LOSS]] (DELAY one way)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds per version")
    ap.add_argument("--spread", type=float, default=0.15, help="seconds over which a round's peers start")
    ap.add_argument("--late", type=float, default=0.0, help="the last peer starts this much later still (a straggler)")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between two rounds")
    ap.add_argument("--timeout", type=float, default=5.0, help="matchmaking timeout per round")
    ap.add_argument("--base", default=BASE, help="the commit to compare against")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sigterm_as_exit()
    from p2ptrain.testing import Testbed

    with tempfile.TemporaryDirectory(prefix="wan-mm-base-") as base_tree:
        _tree(a.base, base_tree)
        with Testbed.from_netem(a.peers, a.netem) as tb:
            print(f"{loadavg()}; {a.peers} peers per version, {tb.describe()}; base {a.base}; "
                  f"starts spread over {a.spread * 1000:.0f} ms", flush=True)
            t = time.monotonic()
            rounds = run(a, tb, base_tree)
            print(f"{loadavg()}; {time.monotonic() - t:.0f} s", flush=True)
            report(rounds, 2 * tb.delay_s)


if __name__ == "__main__":
    run_main(main)
