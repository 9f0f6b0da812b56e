"""Churn soak, short: ``benchmarks/soak.py`` for under a minute, with a kill every few seconds.

The sans-IO core (:mod:`p2ptrain.testing.churn`) is tested first, without processes: who is killed
when, who a newcomer joins through, when a silent peer counts as hung. Then the real thing: the
soak script runs 4 ``p2ptrain peer`` processes and a DHT-only bootstrap on 127.0.0.1, SIGKILLs one
every ~4 s (every third kill the bootstrap) and starts replacements through live peers' addresses.
Its JSON report is checked, and what can be checked independently is: the newest checkpoint
verifies with ``p2ptrain ckpt verify`` and restores into the model with the stated accuracy, no
process of any session the run started is alive, and no temporary file is left in its directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.testing.churn import ChurnSchedule, Kill, ProgressWatch, Start

REPO = Path(__file__).resolve().parent.parent
ACCURACY = 0.95  # digits reaches ~97%; a swarm that lost its state under churn would not


# ---------------------------------------------------------------------------------- sans-IO core


def drive(sched: ChurnSchedule, seconds: float, dt: float = 0.25) -> tuple[list, dict, dict]:
    """Run ``sched`` against an ideal swarm: every started process announces itself at once."""
    trainers = {f"t{i}": f"/ip4/127.0.0.1/tcp/{1000 + i}/p2p/t{i}" for i in range(sched.peers)}
    boots = {"b0": "/ip4/127.0.0.1/tcp/999/p2p/b0"}
    log = []
    t = 0.0
    while t < seconds:
        for a in sched.step(t, trainers, boots):
            log.append((t, a))
            if isinstance(a, Kill):
                (boots if a.bootstrap else trainers).pop(a.name)
            else:
                assert all(j in {*trainers.values(), *boots.values()} for j in a.join), "joins a live peer only"
                (boots if a.bootstrap else trainers)[a.name] = f"/ip4/127.0.0.1/tcp/2000/p2p/{a.name}"
        t += dt
    return log, trainers, boots


def test_schedule_kills_at_the_mean_rate_and_keeps_the_swarm_at_strength():
    log, trainers, boots = drive(ChurnSchedule(peers=6, every=5.0, seed=1, bootstrap_every=4), 600)
    kills = [a for _, a in log if isinstance(a, Kill)]
    assert 100 <= len(kills) <= 140  # 600 s / 5 s, jittered
    boot_kills = [k for k in kills if k.bootstrap]
    assert len(boot_kills) == len(kills) // 4
    assert len(trainers) == 6 and len(boots) == 1
    starts = [a for _, a in log if isinstance(a, Start)]
    assert len(starts) == len(kills) and sum(s.bootstrap for s in starts) == len(boot_kills)
    assert len({a.name for a in starts}) == len(starts), "names are never reused"


def test_schedule_is_deterministic_per_seed():
    a = drive(ChurnSchedule(peers=5, every=3.0, seed=7), 120)[0]
    b = drive(ChurnSchedule(peers=5, every=3.0, seed=7), 120)[0]
    c = drive(ChurnSchedule(peers=5, every=3.0, seed=8), 120)[0]
    assert a == b and a != c


def test_schedule_never_kills_below_min_live_nor_unannounced_peers():
    sched = ChurnSchedule(peers=3, every=1.0, seed=0, min_live=2, bootstrap_every=0)
    trainers = {"a": "/ip4/127.0.0.1/tcp/1/p2p/a", "b": "/ip4/127.0.0.1/tcp/2/p2p/b", "c": None}
    actions = sched.step(0.0, trainers, {}) + sched.step(10.0, trainers, {})
    assert not any(isinstance(a, Kill) for a in actions), "c is still starting: killing a or b leaves one"
    # no bootstrap alive: a replacement bootstrap joins through the live trainers
    boot = [a for a in actions if isinstance(a, Start) and a.bootstrap]
    assert boot and set(boot[0].join) <= {"/ip4/127.0.0.1/tcp/1/p2p/a", "/ip4/127.0.0.1/tcp/2/p2p/b"}


def test_schedule_waits_for_an_address_to_join_through():
    sched = ChurnSchedule(peers=4, every=1.0)
    assert sched.step(0.0, {"a": None}, {"b": None}) == []


def test_a_bootstrap_kill_is_replaced_through_the_survivors():
    sched = ChurnSchedule(peers=2, every=1.0, seed=3, bootstrap_every=1, min_live=1)
    trainers = {"t": "/ip4/127.0.0.1/tcp/1/p2p/t", "u": "/ip4/127.0.0.1/tcp/2/p2p/u"}
    actions = sched.step(0.0, trainers, {"b": "/ip4/127.0.0.1/tcp/9/p2p/b"})
    actions += sched.step(5.0, trainers, {"b": "/ip4/127.0.0.1/tcp/9/p2p/b"})
    assert actions[0] == Kill("b", True)
    start = actions[1]
    assert isinstance(start, Start) and start.bootstrap and "/ip4/127.0.0.1/tcp/9/p2p/b" not in start.join


def test_watch_flags_a_silent_peer_only_while_others_progress():
    w = ProgressWatch(hang_after=10, start_after=30)
    for n in ("a", "b"):
        w.spawned(n, 0.0)
        w.started(n, 1.0, 0)
    for t in range(2, 40):  # a keeps printing, b falls silent after t=5
        w.progress("a", float(t), t)
        if t <= 5:
            w.progress("b", float(t), t)
        w.check(float(t))
    assert [(name, int(t)) for t, name, _ in w.hangs] == [("b", 16)], "once, at the first check past 10 s"
    w.progress("b", 40.0, 40)
    assert w.check(41.0) == []


def test_watch_does_not_flag_a_swarm_wide_pause():
    w = ProgressWatch(hang_after=10)
    for n in ("a", "b"):
        w.spawned(n, 0.0)
        w.progress(n, 1.0, 1)
    assert w.check(30.0) == [], "everyone silent: a pause (e.g. a round timeout), not one hung peer"


def test_watch_flags_a_peer_that_never_starts_and_forgets_the_dead():
    w = ProgressWatch(hang_after=10, start_after=20)
    w.spawned("slow", 0.0)
    w.spawned("dead", 0.0)
    w.gone("dead")
    assert w.check(15.0) == []
    assert [name for _, name, _ in w.check(21.0)] == ["slow"]


def test_watch_epochs_per_minute_from_the_frontier():
    w = ProgressWatch()
    w.spawned("a", 0.0)
    for t in range(0, 61):
        w.progress("a", float(t), 2 * t)
    w.progress("a", 61.0, 5)  # a lagging report does not lower the frontier
    assert w.frontier == 120
    assert w.epochs_per_minute(0.0, 60.0) == pytest.approx(120.0)
    with pytest.raises(ValueError):
        w.epochs_per_minute(5.0, 5.0)


# ------------------------------------------------------------------------------- the real swarm


def _alive(pids: set[int]) -> list[int]:
    """Live (non-zombie) processes that are, or belong to the process group/session of, ``pids``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and (int(entry) in pids or int(fields[2]) in pids or int(fields[3]) in pids):
                out.append(int(entry))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_churn_soak(tmp_path, child_pids):
    before = child_pids()
    workdir, report = tmp_path / "soak", tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--peers", "4", "--minutes", "0.55",
           "--churn-every", "3", "--bootstrap-every", "3", "--checkpoint-every", "20", "--no-baseline",
           "--target", str(ACCURACY), "--workdir", str(workdir), "--json", str(report)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # its peers die with it (PDEATHSIG)
            proc.kill()
            proc.wait()
    assert report.exists(), f"no report (exit code {proc.returncode}):\n{err[-3000:]}"
    r = json.loads(report.read_text())["results"][0]
    context = f"{out}\n{err[-3000:]}"

    assert r["kills"] >= 5 and r["bootstrap_kills"] >= 1, context
    assert r["final_epoch"] > r["epoch_at_last_kill"] > r["epoch_at_first_kill"] > 0, "training advances past the kills"
    assert r["final_epoch"] > r["epoch_at_last_bootstrap_kill"]
    assert r["joins"] and all(j["epoch"] >= j["frontier_at_spawn"] for j in r["joins"]), \
        f"newcomers start from the swarm's state, not from scratch: {r['joins']}"
    assert r["hangs"] == [] and r["losses"] == [], context
    assert r["accuracies"] and min(r["accuracies"]) >= ACCURACY, context
    assert proc.returncode == 0, context

    # the newest checkpoint, checked here rather than taken from the report
    from p2ptrain.checkpoint import restore
    from p2ptrain.checkpoint.store import CheckpointStore
    from p2ptrain.tasks import get_task

    data = workdir / "churn" / "data"
    newest = max(CheckpointStore(data).list(), key=lambda i: i.epoch)
    assert newest.epoch == r["checkpoint"]["epoch"] and newest.epoch >= r["epoch_at_last_kill"] - 20
    verify = subprocess.run([sys.executable, "-m", "p2ptrain", "ckpt", "verify", newest.cid, "--data-dir", str(data)],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stderr
    import torch

    task = get_task("digits")
    model = task.make_model(seed=0)
    state = restore(*CheckpointStore(data).load(newest.manifest_id), copy=True)
    with torch.no_grad():
        for p, t in zip(model.parameters(), state["params"], strict=True):
            p.copy_(t)
    assert task.evaluate(model)["accuracy"] >= ACCURACY

    # nothing left behind: processes, temporary files
    assert _alive(set(r["pids"])) == [] and child_pids() <= before
    temp = [str(p.relative_to(workdir)) for p in workdir.rglob("*")
            if p.is_file() and (p.suffix in (".tmp", ".partial") or p.parent.name in ("tmp", "pending"))]
    assert temp == []


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_soak_cleanly(tmp_path):
    workdir = tmp_path / "soak"
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--peers", "3", "--minutes", "5",
                             "--no-baseline", "--workdir", str(workdir), "--json", str(tmp_path / "r.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the first progress line of the swarm is announced on stderr as "training (epoch N)"
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "training (epoch" in line:
                break
        else:
            raise AssertionError("".join(lines))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "minutes trained" in out, "what was measured so far is printed"
    r = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert r["interrupted"] and r["pids"] and _alive(set(r["pids"])) == []
