"""Churn soak: a swarm trains for minutes while its peers are SIGKILLed and replaced every few seconds.

    python benchmarks/soak.py --peers 8 --minutes 10 --churn-every 5 [--seed 0] [--example digits]

Starts a DHT-only bootstrap process (``p2ptrain dht``) and ``--peers`` training peers
(``p2ptrain peer --json --checkpoint-every K`` sharing one checkpoint store), each its own process
on 127.0.0.1. Every ``--churn-every`` seconds on average (jittered) one process is SIGKILLed --
sometimes the bootstrap -- and replacements join through the addresses of live peers, so the
number of trainers stays at ``--peers`` (:class:`p2ptrain.testing.churn.ChurnSchedule` decides
who and when, seeded). Then the same swarm runs as long without churn, as the baseline.

What it checks, for both runs (``FAIL`` lines and exit code 1 when something is wrong):

* training advances: the epoch frontier (the highest epoch in any peer's progress lines) over time;
* no peer hangs: a live peer silent for ``--hang-after`` s while others progress, or one that does
  not leave within the grace period when asked to stop (SIGTERM) at the end;
* nothing is lost: no peer exits by itself, no newcomer starts behind the swarm's epoch at its spawn
  (a newcomer whose every bootstrap peer died while it started exits with a clear error: that is
  counted as a failed join, not a loss);
* the final model: every surviving peer saves its model (``--save``) when stopped; the saved files
  are evaluated here, on the task's test set, against ``--target``;
* the latest checkpoint: ``p2ptrain ckpt verify`` and ``p2ptrain ckpt export`` on it, the export
  loaded into the example's model (``load_state_dict``, strict) and evaluated like the models;
* nothing is left behind: no process of any session we started, and no temporary file in the work
  directory once ``p2ptrain ckpt gc`` has collected what the SIGKILLed writers left (those are
  listed too).

Prints a table: epochs/minute and accuracy with and without churn, kills, starts, hangs, losses.
Ctrl+C stops the swarm cleanly (a second one kills it) and prints what was measured so far.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from _procs import _signal_group, event_of  # noqa: E402
from p2ptrain.children import die_with_parent  # noqa: E402
from p2ptrain.testing.churn import ChurnSchedule, Kill, ProgressWatch, Start  # noqa: E402

TEMP_MARKERS = (".tmp", ".partial")


class Interrupted(Exception):
    """Ctrl+C or SIGTERM: stop the swarm cleanly and report what was measured."""


# ------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    bootstrap: bool
    popen: subprocess.Popen
    log_path: Path
    spawned: float
    spawn_frontier: int
    addr: str | None = None
    killed: bool = False  # by the churn: its exit is expected
    stopping: bool = False  # asked to leave at the end
    exited: bool = False
    started: dict | None = None
    done: dict | None = None
    save: Path | None = None
    join: tuple[str, ...] = ()

    @property
    def alive(self) -> bool:
        return not self.exited and not self.killed

    def stderr_tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return ""


def child_env() -> dict[str, str]:
    """The environment of every ``p2ptrain`` process we start: ours without P2PTRAIN_* settings
    (each run sets its own), with this checkout importable (the script runs from a checkout that
    need not be installed) and unbuffered output (progress lines arrive as they are printed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return env


class Swarm:
    """The processes of one run: each in its own session (a terminal Ctrl+C reaches only us) with
    PDEATHSIG (if we die, they die); stdout lines land on one queue, stderr in a log per process."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.q: queue.Queue = queue.Queue()
        self.procs: dict[str, Proc] = {}
        self.pids: set[int] = set()
        self.env = child_env()

    def spawn(self, name: str, argv: list[str], bootstrap: bool, frontier: int, save: Path | None = None,
              join: tuple[str, ...] = ()) -> Proc:
        log_path = self.logs / f"{name}.log"
        with open(log_path, "w") as log:
            popen = subprocess.Popen([sys.executable, "-m", "p2ptrain", *argv], cwd=self.workdir, env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1, start_new_session=True, preexec_fn=die_with_parent)
        self.pids.add(popen.pid)
        p = Proc(name, bootstrap, popen, log_path, time.monotonic(), frontier, save=save, join=join)
        self.procs[name] = p
        threading.Thread(target=self._pump, args=(p,), daemon=True).start()
        return p

    def _pump(self, p: Proc) -> None:
        assert p.popen.stdout is not None
        for line in p.popen.stdout:
            obj = event_of(line)
            if obj is not None:
                self.q.put((p.name, time.monotonic(), obj))
        self.q.put((p.name, time.monotonic(), {"event": "_eof"}))

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.killed = True
        _signal_group(p.popen, signal.SIGKILL)
        p.popen.wait()

    def all_dead(self, addrs: tuple[str, ...]) -> bool:
        """Whether every process announcing one of ``addrs`` has died (or been killed)."""
        return bool(addrs) and not any(p.alive and p.addr in addrs for p in self.procs.values())

    def live(self, bootstrap: bool) -> dict[str, str | None]:
        return {p.name: p.addr for p in self.procs.values() if p.alive and p.bootstrap == bootstrap}

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGKILL)
            p.popen.wait()


def leftover_processes(pids: set[int]) -> list[str]:
    """Processes still running that we started, or that belong to a session or process group we
    started (a grandchild), from /proc: no third-party library needed."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if state != "Z" and (int(entry) in pids or pgrp in pids or session in pids):
            out.append(f"pid {entry} ({stat.split('(', 1)[1].rsplit(')', 1)[0]}, state {state})")
    return out


def temp_files(root: Path) -> list[str]:
    """Files under ``root`` that are temporary by name or place: ``*.tmp``/``*.partial`` files,
    anything in a store's ``tmp/`` or ``pending/`` directory."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for f in files:
            if f.endswith(TEMP_MARKERS) or rel.name in ("tmp", "pending"):
                out.append(str(rel / f))
    return sorted(out)


# ------------------------------------------------------------------------------------------- run


@dataclass
class Result:
    label: str
    churn: bool
    seconds: float = 0.0
    epochs_per_min: float = 0.0
    first_epoch: int = 0
    final_epoch: int = 0
    epoch_at_first_kill: int | None = None
    epoch_at_last_kill: int | None = None
    epoch_at_last_bootstrap_kill: int | None = None
    joins: list[dict[str, Any]] = field(default_factory=list)  # newcomers: epochs at spawn and start
    mean_training_peers: float = 0.0  # time-average of live trainers past their start-up
    samples: int = 0  # samples the trainers computed between the start and the stop (their progress lines)
    kills: int = 0
    bootstrap_kills: int = 0
    starts: int = 0
    hangs: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    failed_joins: list[str] = field(default_factory=list)  # all its bootstrap peers died first
    cache_joins: list[str] = field(default_factory=list)  # same, but it joined through its peer cache
    stopped_while_joining: int = 0
    survivors: int = 0
    accuracies: list[float] = field(default_factory=list)
    checkpoint: dict[str, Any] = field(default_factory=dict)
    temp_before_gc: list[str] = field(default_factory=list)
    temp_after_gc: list[str] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    interrupted: bool = False

    def failures(self, target: float | None) -> list[str]:
        f = [f"{self.label}: hung: {h}" for h in self.hangs] + [f"{self.label}: lost: {x}" for x in self.losses]
        if self.final_epoch <= (self.epoch_at_last_kill if self.epoch_at_last_kill is not None else self.first_epoch):
            f.append(f"{self.label}: training did not advance (epoch {self.final_epoch})")
        if not self.accuracies:
            f.append(f"{self.label}: no surviving peer saved a model")
        elif target is not None and min(self.accuracies) < target:
            f.append(f"{self.label}: final accuracy {min(self.accuracies):.4f} < target {target}")
        if not self.checkpoint.get("ok"):
            f.append(f"{self.label}: latest checkpoint: {self.checkpoint.get('error', 'none')}")
        f += [f"{self.label}: temp file left: {t}" for t in self.temp_after_gc]
        f += [f"{self.label}: process left: {p}" for p in self.leftover]
        return f


def trainer_argv(opts: argparse.Namespace, data: Path, save: Path, join: tuple[str, ...], seed: int,
                 wait: int) -> list[str]:
    argv = ["peer", "--json", "--example", opts.example, "--threads", "1", "--epochs", "1000000000",
            "--checkpoint-every", str(opts.checkpoint_every), "--data-dir", str(data), "--save", str(save),
            "--data-seed", str(seed)]
    for a in join:
        argv += ["--bootstrap", a]
    if wait > 1:
        argv += ["--wait-peers", str(wait)]
    return argv


def bootstrap_argv(join: tuple[str, ...]) -> list[str]:
    argv = ["dht", "run", "--listen", "/ip4/127.0.0.1/tcp/0"]
    for a in join:
        argv += ["--bootstrap", a]
    return argv


def run_swarm(opts: argparse.Namespace, workdir: Path, churn: bool, stop: threading.Event) -> Result:
    label = "churn" if churn else "no churn"
    res = Result(label, churn)
    data, models = workdir / "data", workdir / "models"
    models.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(workdir)
    watch = ProgressWatch(hang_after=opts.hang_after, start_after=opts.start_after)
    sched = ChurnSchedule(opts.peers, opts.churn_every, seed=opts.seed, bootstrap_every=opts.bootstrap_every)
    say = _sayer(label)

    def start(name: str, bootstrap: bool, join: tuple[str, ...], wait: int = 0) -> None:
        if bootstrap:
            swarm.spawn(name, bootstrap_argv(join), True, watch.frontier, join=join)
        else:
            save = models / f"{name}.safetensors"
            swarm.spawn(name, trainer_argv(opts, data, save, join, int(name[4:]), wait), False, watch.frontier, save,
                        join)
            watch.spawned(name, time.monotonic())  # the bootstrap prints no progress: it cannot be watched

    def handle(name: str, now: float, ev: dict) -> None:
        p = swarm.procs[name]
        kind = ev.get("event")
        if kind in ("progress", "done"):
            samples[name] = int(ev.get("samples") or 0)
        if kind == "progress":
            watch.progress(name, now, int(ev["epoch"]))
            first.setdefault("progress", now)
        elif kind == "started":
            p.started, p.addr = ev, ev["multiaddrs"][0]
            watch.started(name, now, int(ev["epoch"]))
            behind = p.spawn_frontier - int(ev["epoch"])
            if p.spawn_frontier > 0:
                res.joins.append({"name": name, "frontier_at_spawn": p.spawn_frontier, "epoch": ev["epoch"],
                                  "state_loads": ev.get("state_loads"), "resumed_epoch": ev.get("resumed_epoch"),
                                  "start_s": round(now - p.spawned, 1)})
            if p.spawn_frontier > 0 and behind > opts.checkpoint_every:
                res.losses.append(f"{name} started at epoch {ev['epoch']}, {behind} behind the swarm at its spawn")
        elif kind == "done":
            p.done = ev
        elif kind == "_eof":
            p.exited = True
            rc = p.popen.wait()
            watch.gone(name)
            if p.killed or p.stopping:
                pass
            elif p.addr is None and swarm.all_dead(p.join) and "could not reach any bootstrap peer" in p.stderr_tail():
                # every peer it was told to join through died while it started: the clear error
                # it exits with is the right outcome (a real deployment retries with other peers)
                res.failed_joins.append(f"{name}: {p.stderr_tail(1)[:200]}")
            else:
                res.losses.append(f"{name} exited by itself with code {rc}: {p.stderr_tail()}")
        elif "text" in ev and p.bootstrap and ev["text"].startswith("/ip4/") and p.addr is None:
            p.addr = ev["text"]

    def pump(timeout: float) -> None:
        try:
            name, t, ev = swarm.q.get(timeout=timeout)
        except queue.Empty:
            return
        handle(name, t, ev)
        while True:  # drain without blocking
            try:
                name, t, ev = swarm.q.get_nowait()
            except queue.Empty:
                return
            handle(name, t, ev)

    first: dict[str, float] = {}
    samples: dict[str, int] = {}  # each trainer's samples_total, last reported
    samples_at_t0 = 0
    t0 = t_stop = None
    try:
        boot = sched.name(True)
        start(boot, True, ())
        deadline = time.monotonic() + 60
        while swarm.procs[boot].addr is None:
            if time.monotonic() > deadline or swarm.procs[boot].exited or stop.is_set():
                raise RuntimeError(f"the bootstrap process did not start: {swarm.procs[boot].stderr_tail()}")
            pump(0.25)
        for _ in range(opts.peers):
            start(sched.name(False), False, (swarm.procs[boot].addr,), wait=opts.peers)
        say(f"bootstrap {swarm.procs[boot].addr}, {opts.peers} trainers starting")
        next_note, last, peer_seconds = 0.0, None, 0.0
        while True:
            pump(0.25)
            now = time.monotonic()
            if stop.is_set():
                res.interrupted = True
                break
            if t0 is None:
                if "progress" in first:
                    t0 = first["progress"]
                    samples_at_t0 = sum(samples.values())
                    say(f"training (epoch {watch.frontier}); {'churn' if churn else 'no churn'} "
                        f"for {opts.minutes:g} min")
                elif now - min(p.spawned for p in swarm.procs.values()) > opts.start_after:
                    raise RuntimeError("no peer reported progress within "
                                       f"{opts.start_after:.0f} s: {[p.stderr_tail(2) for p in swarm.procs.values()]}")
                continue
            if now - t0 >= opts.minutes * 60 and (not churn or _recovered(watch, res)
                                                  or now - t0 >= opts.minutes * 60 + opts.hang_after):
                break  # with churn, once the swarm is seen past its last kill (bounded: one that
                # never gets there is reported by Result.failures), not at a fixed time after it
            training = sum(1 for a in swarm.live(False).values() if a)
            peer_seconds += training * (now - (last if last is not None else t0))
            last = now
            for h in watch.check(now):
                res.hangs.append(f"{h[1]}: {h[2]} (at {h[0] - t0:.0f} s)")
                say(f"HANG {res.hangs[-1]}")
            # no churn in the last few seconds: newcomers finish joining, and the run ends once
            # the swarm is seen past the last kill (above)
            if churn and now - t0 < opts.minutes * 60 - min(5.0, 0.2 * opts.minutes * 60):
                for action in sched.step(now, swarm.live(False), swarm.live(True)):
                    if isinstance(action, Kill):
                        if res.epoch_at_first_kill is None:
                            res.epoch_at_first_kill = watch.frontier
                        res.epoch_at_last_kill = watch.frontier
                        if action.bootstrap:
                            res.epoch_at_last_bootstrap_kill = watch.frontier
                        swarm.kill(action.name)
                        watch.gone(action.name)
                        res.bootstrap_kills += action.bootstrap
                    elif isinstance(action, Start):
                        start(action.name, action.bootstrap, action.join)
            if now >= next_note:
                next_note = now + 30
                say(f"{now - t0:5.0f} s  epoch {watch.frontier}  trainers {len(swarm.live(False))}  "
                    f"kills {sched.kills}  starts {sched.starts}  hangs {len(res.hangs)}  losses {len(res.losses)}")
        t_stop = time.monotonic()
        samples_at_stop = sum(samples.values())
        _shutdown(swarm, res, opts.grace, pump, say)
    except KeyboardInterrupt:  # the second Ctrl+C: no grace
        res.interrupted = True
        raise
    finally:
        swarm.kill_all()
        res.pids = sorted(swarm.pids)
        res.kills, res.starts = sched.kills, sched.starts
    if t0 is not None and t_stop is not None and t_stop > t0:
        res.seconds = t_stop - t0
        res.first_epoch = watch.epoch_at(t0)
        res.final_epoch = watch.frontier
        res.epochs_per_min = watch.epochs_per_minute(t0, t_stop)
        res.mean_training_peers = peer_seconds / res.seconds
        res.samples = samples_at_stop - samples_at_t0
    res.leftover = leftover_processes(swarm.pids)
    res.cache_joins = [p.name for p in swarm.procs.values() if _joined_through_cache(p)]
    survivors = [p for p in swarm.procs.values() if not p.bootstrap and p.stopping and p.started is not None]
    res.survivors = len(survivors)
    res.accuracies = [a for p in survivors if (a := _evaluate_file(opts.example, p.save)) is not None]
    res.checkpoint = _check_checkpoint(opts.example, data, workdir)
    res.temp_before_gc = temp_files(workdir)
    if data.exists():  # what `p2ptrain ckpt gc` does, without another interpreter start-up
        from p2ptrain.checkpoint.store import CheckpointStore

        gc = CheckpointStore(data).gc(keep=3, pending_grace=0.0)  # every process has stopped
        res.checkpoint["gc_temp_removed"] = gc.temp_removed
        if gc.problems:
            res.checkpoint.update(ok=False, error=f"gc found problems: {gc.problems[:3]}")
    res.temp_after_gc = temp_files(workdir)
    return res


def _recovered(watch: ProgressWatch, res: Result) -> bool:
    """Whether the epoch frontier has moved past the epoch of the last kill: the run may end."""
    return res.epoch_at_last_kill is None or watch.frontier > res.epoch_at_last_kill


def _joined_through_cache(p: Proc) -> bool:
    """Whether the process logged that every bootstrap address failed and its peer cache (shared
    in ``--data-dir``, as peers of one machine share it) got it in: a join that used to fail."""
    try:
        return "from the peer cache" in p.log_path.read_text(errors="replace")
    except OSError:
        return False


def _shutdown(swarm: Swarm, res: Result, grace: float, pump: Any, say: Any) -> None:
    """SIGTERM every live process (peers finish their step, save their model and leave); one
    that has not exited after ``grace`` seconds is a hang, and is killed."""
    live = [p for p in swarm.procs.values() if p.alive]
    for p in live:
        p.stopping = True
        _signal_group(p.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(not p.exited for p in live) and time.monotonic() < deadline:
        pump(0.25)
    for p in live:
        if not p.exited:
            res.hangs.append(f"{p.name}: still running {grace:.0f} s after SIGTERM: {p.stderr_tail(2)}")
            _signal_group(p.popen, signal.SIGKILL)
        elif p.addr is None:  # asked to stop before it had joined: no state, no model to lose
            res.stopped_while_joining += 1
        elif p.popen.returncode != 0:
            res.losses.append(f"{p.name} exited with code {p.popen.returncode} after SIGTERM: {p.stderr_tail()}")
        elif not p.bootstrap and p.done is None:
            res.losses.append(f"{p.name} left without its done event")
    la = os.getloadavg()
    say(f"stopped {len(live)} processes; load average {la[0]:.1f} {la[1]:.1f} {la[2]:.1f}")


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2ptrain", *argv], cwd=cwd, env=child_env(), capture_output=True,
                          text=True, timeout=120)


def _model(example: str) -> tuple[Any, Any]:
    from p2ptrain.tasks import get_task

    task = get_task(example)
    return task, task.make_model(seed=0)


def _metric(task: Any, model: Any) -> float:
    return float(task.evaluate(model)[task.target_metric])


def _evaluate_file(example: str, path: Path | None) -> float | None:
    """The saved model's test metric, computed here (not the peer's own report)."""
    if path is None or not path.exists():
        return None
    from safetensors.torch import load_file

    task, model = _model(example)
    model.load_state_dict(load_file(str(path)))
    return _metric(task, model)


def _check_checkpoint(example: str, data: Path, workdir: Path) -> dict[str, Any]:
    """The newest checkpoint: verified and exported by the CLI, the export loaded into the
    example's model as a user would (``load_state_dict``, strict) and evaluated."""
    from p2ptrain.checkpoint.store import CheckpointStore

    if not data.exists():
        return {"ok": False, "error": "no checkpoint store was created"}
    infos = CheckpointStore(data).list()
    if not infos:
        return {"ok": False, "error": f"no checkpoint in {data}"}
    newest = max(infos, key=lambda i: (i.epoch, i.created))
    out: dict[str, Any] = {"cid": newest.cid, "epoch": newest.epoch, "count": len(infos), "ok": False}
    verify = _cli(["ckpt", "verify", newest.cid, "--data-dir", str(data)], workdir)
    if verify.returncode != 0:
        out["error"] = f"ckpt verify exited {verify.returncode}: {verify.stderr.strip()[-300:]}"
        return out
    export = workdir / "latest-checkpoint.safetensors"
    exp = _cli(["ckpt", "export", newest.cid, str(export), "--data-dir", str(data)], workdir)
    if exp.returncode != 0:
        out["error"] = f"ckpt export exited {exp.returncode}: {exp.stderr.strip()[-300:]}"
        return out
    from safetensors.torch import load_file

    tensors = load_file(str(export))
    export.unlink()
    out["exported_tensors"] = len(tensors)
    task, model = _model(example)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        out["error"] = f"the export does not load into the {example} model: {str(e).splitlines()[0]}"
        return out
    out["metric"] = _metric(task, model)
    out["ok"] = True
    return out


def _sayer(label: str):
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {label}: {msg}", file=sys.stderr, flush=True)

    return say


# ----------------------------------------------------------------------------------------- report


def table(results: list[Result], target: float | None) -> str:
    rows = [("", *(r.label for r in results))]

    def row(name: str, f: Any) -> None:
        rows.append((name, *(f(r) for r in results)))

    row("minutes trained", lambda r: f"{r.seconds / 60:.2f}")
    row("epochs/minute", lambda r: f"{r.epochs_per_min:.1f}")
    row("epochs (start -> end)", lambda r: f"{r.first_epoch} -> {r.final_epoch}")
    row("samples computed per epoch", lambda r: f"{r.samples / max(1, r.final_epoch - r.first_epoch):.0f}")
    row("trainers past start-up (time average)", lambda r: f"{r.mean_training_peers:.1f}")
    row("final accuracy (min/max of survivors)",
        lambda r: f"{min(r.accuracies):.4f} / {max(r.accuracies):.4f}" if r.accuracies else "-")
    row("surviving peers evaluated", lambda r: f"{len(r.accuracies)}/{r.survivors}")
    row("latest checkpoint (epoch, accuracy)",
        lambda r: f"{r.checkpoint.get('epoch')}, {r.checkpoint['metric']:.4f}" if r.checkpoint.get("ok") else "FAIL")
    row("kills (of them bootstrap)", lambda r: f"{r.kills} ({r.bootstrap_kills})")
    row("starts", lambda r: str(r.starts))
    row("newcomers at the swarm's epoch", lambda r: f"{sum(j['epoch'] >= j['frontier_at_spawn'] for j in r.joins)}"
        f"/{len(r.joins)}" if r.joins else "-")
    row("newcomer start s (median)", lambda r: f"{sorted(j['start_s'] for j in r.joins)[len(r.joins) // 2]:.1f}"
        if r.joins else "-")
    row("failed joins (all bootstrap peers gone)", lambda r: str(len(r.failed_joins)))
    row("joins through the peer cache (same)", lambda r: str(len(r.cache_joins)))
    row("hangs", lambda r: str(len(r.hangs)))
    row("losses", lambda r: str(len(r.losses)))
    row("temp files after kills / after gc", lambda r: f"{len(r.temp_before_gc)} / {len(r.temp_after_gc)}")
    row("processes left", lambda r: str(len(r.leftover)))
    if len(results) == 2 and results[1].epochs_per_min > 0:
        rows.append(("churn / no churn epochs/minute",
                     f"{results[0].epochs_per_min / results[1].epochs_per_min:.2f}x", ""))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    if target is not None:
        lines.append(f"target accuracy {target}")
    return "\n".join(lines)


def _write_json(path: str, obj: Any) -> None:
    """Atomically: a reader never sees half a report."""
    target = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".soak-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=8, help="trainers kept alive (default: %(default)s)")
    ap.add_argument("--minutes", type=float, default=10.0, help="training time of each run (default: %(default)s)")
    ap.add_argument("--churn-every", type=float, default=5.0, metavar="S",
                    help="mean seconds between kills (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="churn schedule seed (default: %(default)s)")
    ap.add_argument("--example", choices=["digits", "char_lm"], default="digits")
    ap.add_argument("--checkpoint-every", type=int, default=20, metavar="N",
                    help="epochs between checkpoints (default: %(default)s)")
    ap.add_argument("--bootstrap-every", type=int, default=5, metavar="N",
                    help="every Nth kill takes the bootstrap process, 0: never (default: %(default)s)")
    ap.add_argument("--hang-after", type=float, default=30.0, metavar="S",
                    help="a live peer silent this long while others progress hangs (default: %(default)s)")
    ap.add_argument("--start-after", type=float, default=120.0, metavar="S",
                    help="a peer not started this long after its spawn hangs (default: %(default)s)")
    ap.add_argument("--grace", type=float, default=30.0, metavar="S",
                    help="seconds the peers get to leave after SIGTERM (default: %(default)s)")
    ap.add_argument("--target", type=float, help="accuracy every survivor must reach (default: 0.95 for digits)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the churn-free run")
    ap.add_argument("--workdir", metavar="DIR", help="work here and keep it (default: a temporary directory, removed)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    opts = ap.parse_args(argv)
    if opts.peers < 3:
        ap.error("--peers must be at least 3 (two must survive every kill)")
    if opts.minutes <= 0 or opts.churn_every <= 0:
        ap.error("--minutes and --churn-every must be positive")
    if opts.checkpoint_every < 1:
        ap.error("--checkpoint-every must be at least 1")
    if opts.target is None and opts.example == "digits":
        opts.target = 0.95
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    stop = threading.Event()
    presses = 0

    def on_signal(_sig: int, _frame: Any) -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            raise KeyboardInterrupt
        print("\nstopping the swarm (Ctrl+C again to kill it)...", file=sys.stderr, flush=True)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    keep = opts.workdir is not None
    root = Path(opts.workdir).resolve() if keep else Path(tempfile.mkdtemp(prefix="p2ptrain-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    print(f"soak: {opts.peers} peers, {opts.minutes:g} min per run, a kill every ~{opts.churn_every:g} s, "
          f"seed {opts.seed}, {opts.example}, {os.cpu_count()} cores; work dir {root}", file=sys.stderr)
    try:
        runs = [True] if opts.no_baseline else [True, False]
        for churn in runs:
            if stop.is_set():
                break
            results.append(run_swarm(opts, root / ("churn" if churn else "baseline"), churn, stop))
    except KeyboardInterrupt:
        print("killed", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"soak: error: {e}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    failures = [f for r in results for f in r.failures(opts.target)]
    print(table(results, opts.target))
    for f in failures:
        print(f"FAIL {f}")
    if opts.json:
        _write_json(opts.json, {"options": vars(opts), "results": [r.__dict__ for r in results],
                                "failures": failures})
    if stop.is_set():
        return 130
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
