"""Resumes of a local swarm from its checkpoints: how many end with every peer in one state.

    python benchmarks/resume_split.py                       # 4 peers, 15 epochs, then 10 resumes of +10
    python benchmarks/resume_split.py --resumes 3 --peers 2 --checkpoint-every 10

What a person does: ``p2ptrain swarm --epochs N --checkpoint-every K``, then the same command
again with more epochs, which resumes from the newest checkpoint. Each run here is that command
(``--json``, one store under a temporary directory); a run "ends with one state" when every peer
printed the same parameter digest in its ``done`` event. Per resume it prints the epochs, the
epoch each peer started at, the distinct final states, and per peer the state loads, failed rounds
and last group size (a peer that trained alone shows group 1); at the end, how many resumes ended
with one state and in how many a peer had to catch up (a state load or a failed round: peers that
start together need neither). Needs about 15-25 s a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_swarm(epochs: int, args: argparse.Namespace, root: str, timeout: float) -> tuple[list[dict], list[dict], float]:
    """One ``p2ptrain swarm --json`` run: its (started events, done events, seconds)."""
    argv = [sys.executable, "-m", "p2ptrain", "swarm", "--json", "--peers", str(args.peers),
            "--epochs", str(epochs), "--checkpoint-every", str(args.checkpoint_every),
            "--out", os.path.join(root, "out"), "--data-dir", os.path.join(root, "data"), *args.extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    seconds = time.perf_counter() - t0
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        print(f"  swarm exited with {proc.returncode}: {proc.stderr.strip()[-500:]}", flush=True)
    started = [e for e in events if e.get("event") == "started"]
    done = [e for e in events if e.get("event") == "done"]
    return started, done, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resumes", type=int, default=10)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--first", type=int, default=15, help="epochs of the first run")
    p.add_argument("--more", type=int, default=10, help="epochs each resume adds")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a run may take")
    p.add_argument("extra", nargs="*", help="more options for p2ptrain swarm (after --)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="p2ptrain-resume-")
    a = os.getloadavg()
    print(f"{args.peers} peers, first run {args.first} epochs, {args.resumes} resumes of +{args.more}, "
          f"checkpoint every {args.checkpoint_every}; load average {a[0]:.2f} on {os.cpu_count()} cores", flush=True)
    one_state = caught_up = 0
    try:
        epochs = args.first
        started, done, s = run_swarm(epochs, args, root, args.timeout)
        digests = {e.get("params_digest") for e in done}
        print(f"first run: {epochs} epochs, {len(done)} peers done, {len(digests)} state(s), {s:.1f} s", flush=True)
        for r in range(1, args.resumes + 1):
            before, epochs = epochs, epochs + args.more
            started, done, s = run_swarm(epochs, args, root, args.timeout)
            digests = {e.get("params_digest") for e in done}
            ok = len(done) == args.peers and len(digests) == 1
            one_state += ok
            caught_up += any(e.get("state_loads") or e.get("failed_rounds") for e in done)
            starts = sorted(e.get("epoch") for e in started)
            peers = " ".join(f"[loads {e.get('state_loads')} failed {e.get('failed_rounds')} "
                             f"group {e.get('group_size')} epoch {e.get('epoch')}]"
                             for e in sorted(done, key=lambda e: e.get("peer", 0)))
            print(f"resume {r}: {before}->{epochs} started at {starts}, {len(done)} done, {len(digests)} state(s)"
                  f"{'' if ok else '  SPLIT'}, {s:.1f} s, load {os.getloadavg()[0]:.2f}; {peers}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{one_state} of {args.resumes} resumes ended with one state; in {caught_up} a peer loaded the swarm's "
          "state or had a failed round", flush=True)
    return 0 if one_state == args.resumes else 1


if __name__ == "__main__":
    sys.exit(main())
