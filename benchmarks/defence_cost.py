"""Cost of the defences without an attacker: this tree against a baseline ref, same run.

    python benchmarks/defence_cost.py                  # baseline a6c3b74 (before issue 27), 2 repeats
    python benchmarks/defence_cost.py --quick          # smoke run, a few minutes
    python benchmarks/defence_cost.py --baseline HEAD~5 --repeats 3 --keep

The baseline ref is checked out in a detached git worktree under the temp dir (reused when already
there, removed at the end and on Ctrl+C unless ``--keep``). Every benchmark runs as a child process
whose cwd and PYTHONPATH are its tree, so that it and the peers it starts import that tree's
``p2ptrain`` and ``dht``, not the editable install's (whose finder comes after PYTHONPATH; checked
first, and printed). The trees take turns job by job, in an order reversed every other repeat
(baseline current, current baseline, ...), so that a drift of this shared box costs both alike:

- utilisation: each tree's own ``benchmarks/utilisation.py --modes sync`` (4 peers, 50 ms steps),
  once per rule of ``--rules``, which reaches the peers as ``P2PTRAIN_AGGREGATION`` (both trees'
  peer CLIs read it). Figures, from the run's saved events through ``utilisation.analyse`` (full
  precision): swarm samples/s, its share of N x one peer alone, the lone peer's samples/s, CPU %
  per peer, step() pause, matchmaking and all-reduce seconds per round (medians over peer-rounds).
- round time: THIS tree's ``benchmarks/allreduce_bench.py`` (the baseline's cannot name a rule),
  run in each tree: N members on loopback, codec none under each rule of ``--ar-rules``; s/round
  (the slowest member) and CPU s per member per round.

"current" is the working tree this file is in, uncommitted edits included. The table gives, per
figure, the median over the repeats for each tree and current / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import REPO, _signal_group, run_main, sigterm_as_exit  # noqa: E402
from utilisation import _med, analyse  # noqa: E402

RULES = ["mean", "trimmed_mean", "median", "centered_clip"]
AR_SCRIPT = os.path.join(REPO, "benchmarks", "allreduce_bench.py")
UTIL_LONE = re.compile(r"^baseline (\d+) samples/s per peer", re.M)
AR_ROW = re.compile(r"^N=(\d+) p2ptrain (\S+)\s*: ([\d.]+) s/round.*cpu/rank ([\d.]+) s(.*)$", re.M)


def _git(*args: str, cwd: str = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_worktree(ref: str) -> str:
    """A detached worktree of ``ref`` under the temp dir: the existing one if it is there at that commit."""
    sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    path = os.path.join(tempfile.gettempdir(), f"p2ptrain-baseline-{sha[:12]}")
    if os.path.isdir(path):
        try:
            if _git("rev-parse", "HEAD", cwd=path) == sha:
                print(f"baseline {ref} = {sha[:12]}: reusing the worktree {path}", flush=True)
                return path
        except subprocess.CalledProcessError:
            pass
        sys.exit(f"{path} exists and is not a worktree at {sha[:12]}: remove it first")
    _git("worktree", "add", "--detach", path, sha)
    print(f"baseline {ref} = {sha[:12]}: worktree {path}", flush=True)
    return path


def remove_worktree(path: str) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO, capture_output=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def tree_env(tree: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}  # no stray settings
    env["PYTHONPATH"] = os.pathsep.join(p for p in [tree, os.environ.get("PYTHONPATH", "")] if p)
    env.update(extra)
    return env


def check_imports(name: str, tree: str) -> None:
    """Exit unless a child started like the benchmarks' (cwd and PYTHONPATH = tree) imports the tree."""
    code = "import dht, p2ptrain; print(p2ptrain.__file__); print(dht.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=tree_env(tree), capture_output=True,
                         text=True, check=True).stdout.split()
    print(f"{name}: imports {out[0]} and {out[1]}", flush=True)
    if not all(os.path.realpath(f).startswith(os.path.realpath(tree) + os.sep) for f in out):
        sys.exit(f"{name}: the benchmarks would not import the tree {tree}")


def run_child(argv: list[str], tree: str, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run a benchmark in its own session (a Ctrl+C reaches us only); on our way out (Ctrl+C, an
    error, ``timeout``) SIGTERM its group, which stops its peers, and SIGKILL it after 20 s."""
    p = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        return -1, f"(timed out after {timeout:.0f} s)"
    finally:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()


def utilisation(tree: str, rule: str, a: argparse.Namespace) -> tuple[dict[str, float], str]:
    """The swarm's figures at full precision: its saved events through ``analyse`` (the same in both
    trees), against the lone peer's samples/s as the run printed it."""
    with tempfile.NamedTemporaryFile(suffix=".json") as save:
        argv = [sys.executable, os.path.join(tree, "benchmarks", "utilisation.py"), "--modes", "sync",
                "--peers", str(a.peers), "--epochs", str(a.epochs), "--target-batch-size", str(a.target),
                "--baseline-target", str(a.target // 4), "--baseline-epochs", "3", "--save", save.name]
        rc, out = run_child(argv, tree, tree_env(tree, P2PTRAIN_AGGREGATION=rule), a.timeout)
        lone = UTIL_LONE.search(out)
        if rc != 0 or not lone:
            return {}, out
        res = analyse(json.load(save)[0], 1, float(lone[1]))
    if "error" in res:
        return {}, out + "\n" + res["error"]
    p = f"sync {rule}:"
    return {f"{p} swarm samples/s": res["swarm_sps"], f"{p} % of N x alone": 100 * res["ratio"],
            f"{p} lone peer samples/s": float(lone[1]), f"{p} CPU % per peer": res["cpu_pct"],
            f"{p} step() pause s/round": _med(res["pause"]), f"{p} matchmaking s/round": _med(res["mm"]),
            f"{p} all-reduce s/round": _med(res["ar"])}, out


def round_time(tree: str, a: argparse.Namespace) -> tuple[dict[str, float], str]:
    codecs = ["none" if r == "mean" else f"none+{r}" for r in a.ar_rules]
    argv = [sys.executable, AR_SCRIPT, "--n", str(a.ar_n), "--numel", str(a.ar_numel), "--codecs", *codecs,
            "--rounds", str(a.ar_rounds), "--no-gloo", "--no-tcp", "--no-check", "--kill-trials", "0"]
    rc, out = run_child(argv, tree, tree_env(tree), a.timeout)
    rows = AR_ROW.findall(out)
    if rc != 0 or len(rows) != len(codecs) or any("NOT OK" in r[4] for r in rows):
        return {}, out
    figs: dict[str, float] = {}
    for n, codec, t, cpu, _ in rows:
        rule = codec.partition("+")[2] or "mean"
        figs[f"all-reduce N={n} {rule}: s/round"] = float(t)
        figs[f"all-reduce N={n} {rule}: CPU s/member"] = float(cpu)
    return figs, out


def table(figs: dict[str, dict[str, list[float]]]) -> None:
    w = max([6] + [len(k) for k in figs])
    print(f"\n  {'figure':{w}s}  {'baseline':>10}  {'current':>10}  current/baseline  (runs)")  # medians
    for k, per in figs.items():
        b, c = (statistics.median(per[t]) if per.get(t) else float("nan") for t in ("baseline", "current"))
        ratio = f"{c / b:16.3f}" if b == b and c == c and b != 0 else f"{'-':>16}"
        print(f"  {k:{w}s}  {b:10.4g}  {c:10.4g}  {ratio}  ({len(per.get('baseline', []))}, "
              f"{len(per.get('current', []))})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="a6c3b74", metavar="REF", help="git ref to compare with (default: "
                    "a6c3b74, the code before issue 27's defences)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each job per tree (median)")
    ap.add_argument("--rules", nargs="*", default=["mean", "trimmed_mean"], choices=RULES,
                    help="utilisation runs' rules")
    ap.add_argument("--ar-rules", nargs="*", default=["mean", "trimmed_mean", "centered_clip"],
                    choices=RULES, help="all-reduce rounds' rules")
    ap.add_argument("--peers", type=int, default=4, help="utilisation: swarm peers")
    ap.add_argument("--epochs", type=int, default=8, help="utilisation: epochs of the swarm (the first skipped)")
    ap.add_argument("--target", type=int, default=8192, help="utilisation: target batch size (~3 s epochs)")
    ap.add_argument("--ar-n", type=int, default=4, help="all-reduce: group size")
    ap.add_argument("--ar-numel", type=int, default=1 << 21, help="all-reduce: float32 values per member")
    ap.add_argument("--ar-rounds", type=int, default=10, help="all-reduce: measured rounds per rule (after 3 warm-up)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per benchmark run before it is stopped")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, short runs (figures are noise)")
    ap.add_argument("--keep", action="store_true", help="leave the baseline worktree (the next run reuses it)")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.peers, a.epochs, a.target = 1, 3, 4, 2048
        a.ar_n, a.ar_numel, a.ar_rounds = 3, 1 << 18, 5
    sigterm_as_exit()
    t0 = time.monotonic()
    base = make_worktree(a.baseline)
    try:
        trees = {"baseline": base, "current": REPO}
        for name, tree in trees.items():
            check_imports(name, tree)
        jobs = [(f"utilisation {r}", lambda t, r=r: utilisation(t, r, a)) for r in a.rules]
        if a.ar_rules:
            jobs.append(("all-reduce", lambda t: round_time(t, a)))
        figs: dict[str, dict[str, list[float]]] = {}
        for rep in range(a.repeats):
            order = ["baseline", "current"] if rep % 2 == 0 else ["current", "baseline"]
            for job, fn in jobs:
                for name in order:
                    t1 = time.monotonic()
                    got, out = fn(trees[name])
                    print(f"[{rep + 1}/{a.repeats}] {name:8s} {job}: {time.monotonic() - t1:.0f} s"
                          f"{'' if got else ' FAILED; its output ends:'}", flush=True)
                    if not got:
                        print("    " + "\n    ".join(out.strip().splitlines()[-15:]), flush=True)
                    for k, v in got.items():
                        figs.setdefault(k, {}).setdefault(name, []).append(v)
        print(f"\nbaseline {a.baseline} vs the working tree {REPO}; {a.repeats} repeat(s); "
              f"total {time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        table(figs)
    finally:
        if not a.keep:
            remove_worktree(base)


if __name__ == "__main__":
    run_main(main)
