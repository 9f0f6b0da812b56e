"""Convergence at equal samples: one plain torch process vs a swarm of p2ptrain peers (sync, DiLoCo)
vs hivemind.Optimizer, on the built-in tasks, with every baseline measured in the same run.

    python benchmarks/convergence.py --task digits     # baseline, sync, diloco: ~1.5 min on 2 busy cores
    python benchmarks/convergence.py --task char_lm    # ~10 min
    python benchmarks/convergence.py --task digits --runs hivemind --hivemind-python /tmp/hmvenv/bin/python
    python benchmarks/convergence.py --task char_lm --runs --simulate    # baseline + DiLoCo ablations only
    python benchmarks/convergence.py --task char_lm --peers 2 --samples 16000 --runs diloco diloco-overlap \
        --simulate-overlap    # blocking vs overlapped outer rounds: ~6 min

Runs, each trained on the same total number of samples N (``--samples``):

* ``baseline``: the single-process baseline: a plain torch loop (the task's model, seed, optimizer,
  lr and batch size: what :func:`p2ptrain.tasks.train_single` does), evaluated at N and at every
  swarm's *actual* total (peers cannot stop on an exact sample count), so each swarm is compared
  with the baseline at the samples it really trained on.
* ``baseline bs=T``: the same loop with batch ``--target-batch-size``, N/T steps: what a sync swarm
  computes on one machine (one optimizer step per T samples). It separates what large-batch
  training costs from what the trainer costs.
* ``sync``: ``--peers`` real processes ``python -m p2ptrain peer --json --mode sync`` (every peer a
  process of its own, the first one's multiaddr, read from its ``started`` event, the others'
  bootstrap), ``--epochs N/T``; their final ``params_digest`` must be equal.
* ``diloco``: the same with ``--mode diloco --local-steps H --compression int8``, ``--epochs
  N/(P*H*b)`` outer rounds, where b is the task's DiLoCo batch per peer (``--diloco-batch-size``:
  char_lm 2 = its batch 8 / 4 peers, so each replica takes as many steps as the baseline), plus the
  task's outer momentum and inner lr warmup (``--warmup-steps``; the baseline warms up the same way).
* ``diloco-overlap``: the same as ``diloco`` with ``--overlap-outer`` (each outer round runs
  during the next inner steps); reported against ``diloco`` too (final loss ratio, target <= 1.02).
* ``hivemind``: with ``--hivemind-python``, hivemind.Optimizer (its collaborative mode: gradients
  averaged every T samples, the equivalent of ``sync``) in ``--peers`` processes of that
  interpreter (``benchmarks/_hivemind_optimizer.py``), same task, batch, lr and N.
* ``--simulate``: DiLoCo in this one process (P replicas in turn, every round exact and complete):
  with the swarm's settings, then with fp32 pseudo-gradients, then without outer momentum. What the
  algorithm itself gives, without networking, staleness or stragglers: it tells a gap that is
  DiLoCo's from one that is the trainer's, and which knob it comes from.
* ``--simulate-overlap``: the same simulation with blocking rounds and with overlapped ones whose
  average lands ``--overlap-steps`` inner steps into the next round (default H, the worst case:
  the whole round in flight), same seeds and inner steps (on a LAN a round lands after a few).

Printed: final accuracy (digits) / loss / perplexity (char_lm), the delta vs the baseline at the
same samples (%), swarm samples/s (sum of the peers' samples / the slowest peer's training time),
wall seconds (process start to last exit), bytes sent per peer, what an fp32 all-reduce after
every local step would send per peer (2 (P-1)/P * 4 bytes * numel * steps per peer) and the ratio.
The target: DiLoCo within 2 % of the baseline (accuracy for digits, loss for char_lm) while
sending >= 100x fewer bytes than that all-reduce.

The machine is shared and small: every process uses ``--threads`` torch threads (default 1) and the
load average is printed with the figures. Every child runs in its own process group and is stopped
(SIGTERM, then SIGKILL) on exit, on Ctrl+C and when a run exceeds ``--run-timeout``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Per task: what we chose (see --help of each flag; the report explains the choices).
DEFAULTS: dict[str, dict[str, Any]] = {
    # digits: 1437 training images; 64k samples = ~45 passes; the baseline is at ~97% long before
    "digits": {"samples": 64000, "batch_size": 32, "lr": None, "target_batch_size": 512,
               "diloco_batch_size": 32, "warmup_steps": 0, "outer_momentum": 0.9},
    # char_lm: 421k-parameter transformer; batch 8 keeps the number of steps up on a 2-core machine.
    # It is step-limited at this budget, so each DiLoCo peer takes batch 8/4 = 2: the swarm's
    # per-step batch is the baseline's and every replica takes as many steps as the baseline (at
    # batch 8 each replica took 500 steps against 2000 and ended +26%). From random init, H=50
    # steps at full lr left the average stuck on the loss plateau for one seed in two: a 200-step
    # inner lr warmup (the baseline gets the same) fixes that, and outer momentum 0.8 did better
    # than 0.9 (simulated, 2 seeds). 32k samples: at 16k the best of these was still +4.4-4.7%.
    "char_lm": {"samples": 32000, "batch_size": 8, "lr": None, "target_batch_size": 64,
                "diloco_batch_size": 2, "warmup_steps": 200, "outer_momentum": 0.8},
}


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load average {a:.2f} {b:.2f} {c:.2f} on {os.cpu_count()} cores"


# ---------------------------------------------------------------------- child processes


class Children:
    """Every child process of this benchmark, each in a process group of its own (it may have
    children of its own: hivemind forks its DHT and averagers); stopped on exit whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        p = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self.procs.append(p)
        return p

    @staticmethod
    def _signal(p: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, procs: list[subprocess.Popen] | None = None, grace: float = 10.0) -> None:
        """SIGTERM (a peer then leaves cleanly and prints ``done``), wait ``grace``, SIGKILL the rest;
        always SIGKILL the process group afterwards so that no grandchild outlives us."""
        procs = self.procs if procs is None else procs
        for p in procs:
            if p.poll() is None:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            self._signal(p, signal.SIGKILL)  # the group: also whatever the child left behind
            if p.poll() is None:
                p.wait()
        self.procs = [p for p in self.procs if p not in procs]


CHILDREN = Children()


class Lines:
    """JSON lines from several children's stdout, merged into one queue of (index, event)."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def attach(self, index: int, proc: subprocess.Popen) -> None:
        def pump() -> None:
            for line in proc.stdout:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    self.q.put((index, json.loads(line)))
                except ValueError:
                    continue
            self.q.put((index, {"event": "exit"}))

        threading.Thread(target=pump, daemon=True).start()

    def get(self, timeout: float) -> tuple[int, dict] | None:
        try:
            return self.q.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None


def child_env(threads: int) -> dict[str, str]:
    # no P2PTRAIN_* (bootstrap peers, flags): the benchmark says everything on the command line
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


# ---------------------------------------------------------------------- results


@dataclass
class Result:
    name: str
    metrics: dict[str, float] = field(default_factory=dict)  # final (mean over peers)
    samples: int = 0  # total over the swarm
    train_s: float = 0.0  # slowest peer's training time (after --wait-peers), or the loop's
    wall_s: float = 0.0  # process start to last exit
    peers: list[dict] = field(default_factory=list)  # the peers' done events
    bytes_sent: float | None = None  # per peer, mean
    steps_per_peer: float = 0.0
    note: str = ""
    ok: bool = True

    @property
    def sps(self) -> float:
        return self.samples / self.train_s if self.train_s > 0 else 0.0


# ---------------------------------------------------------------------- the baselines (in this process)


def collect_done(procs: list[subprocess.Popen], lines: Any, deadline: float, res: Any, timeout: float,
                 drain: float, stop: Any) -> dict[int, dict]:
    """Gather every peer's ``done`` event until all have exited. Past ``deadline`` the run is too
    slow: ``stop(proc, SIGTERM)`` asks each live peer to leave (they evaluate and print ``done``),
    ``res`` is marked stopped, and the peers get ``drain`` more seconds."""
    done: dict[int, dict] = {}
    exited: set[int] = set()
    stopped = False
    while len(exited) < len(procs):
        now = time.monotonic()
        if now >= deadline and not stopped:
            res.ok, res.note, stopped = False, f"stopped at the {timeout:.0f} s limit", True
            for p in procs:
                if p.poll() is None:
                    stop(p, signal.SIGTERM)
            deadline = now + drain
        elif now >= deadline:
            break
        got = lines.get(min(1.0, deadline - now))
        if got is None:
            continue
        i, ev = got
        if ev["event"] == "done":
            done[i] = ev
        elif ev["event"] == "exit":
            exited.add(i)
    return done


def plain_loop(task: Any, batch_size: int, lr: float | None, steps: int, eval_at: set[int],
               seed: int = 0, warmup_steps: int = 0) -> tuple[dict[int, dict[str, float]], float, dict[str, float]]:
    """:func:`~p2ptrain.tasks.train_single`, evaluated after every step in ``eval_at`` (and at the
    end). Returns ({step: metrics}, training seconds without the evaluations, final metrics)."""
    from p2ptrain.tasks import train_single

    res = train_single(task, steps, batch_size, lr, seed, eval_at=set(eval_at) | {steps}, warmup_steps=warmup_steps)
    evals = {h["step"]: {k: v for k, v in h.items() if k not in ("step", "samples", "seconds")}
             for h in res["history"]}
    return evals, res["seconds"], evals[steps]


def simulate_diloco(task: Any, peers: int, batch_size: int, lr: float | None, rounds: int, local_steps: int,
                    codec_name: str, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                    seed: int = 0, warmup_steps: int = 0,
                    overlap: int | None = None) -> tuple[dict[str, float], float, int]:
    """DiLoCo with ``peers`` replicas in this process, every round complete and synchronous: each
    replica (its own inner AdamW and data order, like a peer) takes ``local_steps`` steps from the
    outer parameters; the pseudo-gradients (outer - local) go through the codec as in the swarm's
    all-reduce (each shard's owner adds its own exactly, the others' through the codec; the average
    through the codec again); Nesterov SGD on the outer parameters. ``overlap``: the replicas do not
    wait for the round: they train on, and its average lands ``overlap`` steps into the next
    round, merged as ``overlap_outer`` merges it (``outer_swap.land_overlapped``). Returns
    (metrics, seconds, samples)."""
    import torch

    from p2ptrain.compression import get_codec
    from p2ptrain.optim.diloco_step import overlap_mix
    from p2ptrain.optim.outer_swap import eager_start, land_overlapped
    from p2ptrain.optim.warmup import warmed_step

    codec = get_codec(codec_name)
    models = [task.make_model(seed) for _ in range(peers)]
    inner = [task.make_optimizer(m.parameters(), lr) for m in models]
    data = [task.batches(batch_size, seed=1000 + r) for r in range(peers)]
    outer = [p.detach().clone() for p in models[0].parameters()]
    outer_opt = torch.optim.SGD(outer, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        if codec.name == "none":
            return x
        enc = codec.encode(x.contiguous())
        return codec.decode(enc.meta, b"".join(bytes(m) for m in enc.memoryviews()))

    landing = False  # overlap: a round's outer step (taken at its end, here) is still to land in the replicas

    def land(m: torch.nn.Module) -> None:
        land_overlapped(list(m.parameters()), outer, overlap_mix(outer_lr, outer_momentum), lambda: None)

    seconds, samples, steps = 0.0, 0, [0] * peers
    for _ in range(rounds):
        t0 = time.perf_counter()
        deltas = []
        for r, (m, opt, it) in enumerate(zip(models, inner, data)):
            m.train()
            for k in range(local_steps):
                if landing and k == overlap:
                    land(m)
                batch = next(it)
                loss = task.loss(m, batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                steps[r] += 1
                warmed_step(opt, steps[r], warmup_steps)
                samples += len(batch[1])
            if landing and overlap is not None and overlap >= local_steps:
                land(m)  # (at the round's end, before its pseudo-gradient)
            if overlap is None:
                with torch.no_grad():
                    deltas.append(torch.cat([(o - p).flatten() for o, p in zip(outer, m.parameters())]))
            else:  # the pseudo-gradient; the replica trains on eagerly, as overlap_outer does
                flat = torch.empty(sum(o.numel() for o in outer))
                eager_start(outer, list(m.parameters()), list(flat.split([o.numel() for o in outer])), outer_opt)
                deltas.append(flat)
        numel = deltas[0].numel()
        bounds = [numel * j // peers for j in range(peers + 1)]
        avg = torch.empty(numel)
        for j in range(peers):  # shard j is owned (and reduced) by replica j
            a, b = bounds[j], bounds[j + 1]
            if a == b:
                continue
            acc = deltas[j][a:b].clone()
            for r in range(peers):
                if r != j:
                    acc += roundtrip(deltas[r][a:b])
            avg[a:b] = roundtrip(acc / peers)
        with torch.no_grad():
            off = 0
            for o in outer:
                o.grad = avg[off: off + o.numel()].view_as(o).clone()
                off += o.numel()
            outer_opt.step()
            if overlap is not None:  # (lands in the next round; the outer step can be taken now)
                landing = True
            else:
                for m in models:
                    for p, o in zip(m.parameters(), outer):
                        p.copy_(o)
        seconds += time.perf_counter() - t0
    with torch.no_grad():  # the model of the swarm: the outer parameters (finish_round)
        for p, o in zip(models[0].parameters(), outer):
            p.copy_(o)
    return task.evaluate(models[0]), seconds, samples


# ---------------------------------------------------------------------- swarms


def run_p2ptrain_swarm(name: str, task_name: str, peers: int, extra: list[str], timeout: float,
                       threads: int, logdir: str, start_timeout: float = 120.0) -> Result:
    """``peers`` processes of ``python -m p2ptrain peer --json``; the first one's multiaddr (from its
    ``started`` event) is everyone else's bootstrap. Returns their ``done`` events."""
    env = child_env(threads)
    empty = os.path.join(logdir, "no-bootstrap.txt")
    open(empty, "w").close()
    base = [sys.executable, "-m", "p2ptrain", "-v", "peer", "--json", "--example", task_name,
            "--wait-peers", str(peers), *extra]
    lines = Lines()
    procs: list[subprocess.Popen] = []
    logs = []
    res = Result(name)
    boot = ""
    t_start = time.monotonic()
    try:
        for i in range(peers):
            log = open(os.path.join(logdir, f"{name}-peer{i}.log"), "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            argv = base + ["--data-seed", str(i)] + (["--bootstrap-file", empty] if i == 0 else ["--bootstrap", boot])
            p = CHILDREN.spawn(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            lines.attach(i, p)
            if i == 0:
                deadline = time.monotonic() + start_timeout
                while True:
                    got = lines.get(deadline - time.monotonic())
                    if got is None or got[1]["event"] == "exit":
                        raise RuntimeError(f"the first peer did not start (see {log.name})")
                    if got[1]["event"] == "started":
                        boot = got[1]["multiaddrs"][0]
                        break
        done = collect_done(procs, lines, t_start + timeout, res, timeout, drain=30.0, stop=CHILDREN._signal)
        res.wall_s = time.monotonic() - t_start
    finally:
        CHILDREN.stop(procs, grace=10.0)
        for log in logs:
            log.close()
    res.peers = [done[i] for i in sorted(done)]
    if len(done) < peers:
        res.ok = False
        res.note = (res.note + "; " if res.note else "") + f"{peers - len(done)} peer(s) printed no done event"
    return finish(res)


def run_hivemind_swarm(python: str, task_name: str, peers: int, job: dict, timeout: float, threads: int,
                       logdir: str, start_timeout: float = 180.0) -> Result:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hivemind_optimizer.py")
    env = child_env(threads)
    env["PYTHONPATH"] = ""  # its own interpreter: the script adds the repo root for p2ptrain.tasks only
    lines = Lines()
    procs: list[subprocess.Popen] = []
    logs = []
    res = Result("hivemind")
    t_start = time.monotonic()
    try:
        maddrs: list[str] = []
        started: set[int] = set()
        for i in range(peers):
            log = open(os.path.join(logdir, f"hivemind-peer{i}.log"), "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            spec = dict(job, task=task_name, rank=i, peers=maddrs, threads=threads)
            p = CHILDREN.spawn([python, script, json.dumps(spec)], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            lines.attach(i, p)
            if i == 0:  # the others need its address
                deadline = time.monotonic() + start_timeout
                while 0 not in started:
                    got = lines.get(deadline - time.monotonic())
                    if got is None or got[1]["event"] == "exit":
                        raise RuntimeError(f"hivemind peer 0 did not start (see {log.name})")
                    if "error" in got[1]:
                        raise RuntimeError(got[1]["error"])
                    if got[1]["event"] == "started":
                        maddrs = got[1]["maddrs"]
                        started.add(0)
        deadline = time.monotonic() + start_timeout
        while len(started) < peers:
            got = lines.get(deadline - time.monotonic())
            if got is None or got[1]["event"] == "exit":
                raise RuntimeError(f"a hivemind peer did not start (logs in {logdir})")
            if got[1]["event"] == "started":
                started.add(got[0])
        t_go = time.monotonic()
        for p in procs:  # a barrier, like --wait-peers: nobody trains alone while the others start
            p.stdin.write("go\n")
            p.stdin.flush()
        # SIGTERM to the script alone (not its group, which holds hivemind's daemon): it stops
        # training, evaluates and prints done
        done = collect_done(procs, lines, t_go + timeout, res, timeout, drain=40.0,
                            stop=lambda p, sig: os.kill(p.pid, sig))
        res.wall_s = time.monotonic() - t_start
    except RuntimeError as e:
        res.ok, res.note = False, str(e)
    finally:
        CHILDREN.stop(procs, grace=15.0)
        for log in logs:
            log.close()
    res.peers = [done[i] for i in sorted(done)] if "done" in locals() else []
    if len(res.peers) < peers and res.ok:
        res.ok = False
        res.note = f"{peers - len(res.peers)} peer(s) printed no done event"
    return finish(res)


def finish(res: Result) -> Result:
    ps = res.peers
    if not ps:
        return res
    res.samples = sum(int(p["samples"]) for p in ps)
    res.train_s = max(float(p["seconds"]) for p in ps)
    keys = ps[0]["metrics"].keys()
    res.metrics = {k: sum(p["metrics"][k] for p in ps) / len(ps) for k in keys}
    res.steps_per_peer = sum(int(p["steps"]) for p in ps) / len(ps)
    if all(p.get("bytes_sent") is not None for p in ps):
        res.bytes_sent = sum(int(p["bytes_sent"]) for p in ps) / len(ps)
    return res


# ---------------------------------------------------------------------- report


def metric_of(task_name: str) -> tuple[str, bool]:
    """(the metric the 2 % target is on, larger is better)."""
    return ("accuracy", True) if task_name == "digits" else ("loss", False)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def print_peers(res: Result) -> None:
    for i, p in enumerate(res.peers):
        m = " ".join(f"{k} {v:.4f}" for k, v in p["metrics"].items())
        extra = ""
        if "rounds" in p:
            extra = (f" rounds {p['rounds']} failed {p['failed_rounds']} group {p['group_size']}"
                     f" state_loads {p['state_loads']} sent {fmt_bytes(p['bytes_sent'])}")
            if p.get("overlapped_steps"):
                extra += f" overlapped {p['overlapped_steps']}"
        print(f"    peer {i}: epoch {p['epoch']} steps {p['steps']} samples {p['samples']} "
              f"{p['seconds']:.1f} s{extra} | {m} | digest {p.get('params_digest', '-')}", flush=True)


def digest_check(res: Result) -> str:
    digests = [p.get("params_digest") for p in res.peers]
    if not digests or None in digests:
        return "-"
    distinct = len(set(digests))
    return "equal" if distinct == 1 else f"DIFFER ({distinct} distinct)"


def table(task_name: str, rows: list[tuple[Result, dict[str, float] | None]], numel: int, peers: int) -> None:
    key, larger = metric_of(task_name)
    cols = ["accuracy", "loss"] if task_name == "digits" else ["loss", "perplexity"]
    print(f"\n== {task_name}: {numel} parameters, {peers} peers; {load()}")
    head = (f"{'run':<20} {cols[0]:>9} {cols[1]:>10}  {'vs base':>8}  {'samples':>8}  {'samples/s':>9}  "
            f"{'train s':>7}  {'wall s':>6}  {'sent/peer':>9}  {'fp32 AR/peer':>12}  {'ratio':>7}  check")
    print(head)
    print("-" * len(head))
    for res, ref in rows:
        if not res.metrics:
            print(f"{res.name:<20} {'-':>9} {'-':>10}  {'-':>8}  {'-':>8}  {'-':>9}  {'-':>7}  {'-':>6}  {'-':>9}  "
                  f"{'-':>12}  {'-':>7}  FAILED: {res.note}")
            continue
        a, b = (res.metrics.get(c, math.nan) for c in cols)
        if ref is not None and key in ref:
            d = (res.metrics[key] - ref[key]) / ref[key] * 100
            delta = f"{d:+7.2f}%"
        else:
            delta = f"{'-':>8}"
        fp32 = ratio = None
        if res.peers and "bytes_sent" in res.peers[0]:
            fp32 = 2 * (peers - 1) / peers * 4 * numel * res.steps_per_peer
            if res.bytes_sent:
                ratio = fp32 / res.bytes_sent
        check = []
        if len(res.peers) > 1:
            check.append(f"digests {digest_check(res)}")
        if ref is not None and key in ref and res.name.startswith(("diloco", "sim")):
            within = (res.metrics[key] >= ref[key] * 0.98) if larger else (res.metrics[key] <= ref[key] * 1.02)
            check.append(f"2% {'ok' if within else 'MISSED'}")
            if ratio is not None:
                check.append(f">=100x {'ok' if ratio >= 100 else 'MISSED'}")
        if res.note:
            check.append(res.note)
        print(f"{res.name:<20} {a:9.4f} {b:10.4f}  {delta}  {res.samples:8d}  {res.sps:9.0f}  {res.train_s:7.1f}  "
              f"{res.wall_s:6.1f}  {fmt_bytes(res.bytes_sent):>9}  {fmt_bytes(fp32):>12}  "
              f"{(f'{ratio:.0f}x' if ratio else '-'):>7}  {'; '.join(check)}", flush=True)


# ---------------------------------------------------------------------- one task


def bench_task(task_name: str, args: argparse.Namespace, logdir: str) -> None:
    import torch

    from p2ptrain.tasks import get_task

    torch.set_num_threads(args.threads)
    d = DEFAULTS[task_name]
    n = args.samples or d["samples"]
    bs = args.batch_size or d["batch_size"]
    dbs = args.diloco_batch_size or d["diloco_batch_size"]
    warm = d["warmup_steps"] if args.warmup_steps is None else args.warmup_steps
    mom = d["outer_momentum"] if args.outer_momentum is None else args.outer_momentum
    lr = args.lr if args.lr is not None else d["lr"]
    tbs = args.target_batch_size or d["target_batch_size"]
    h, P = args.local_steps, args.peers
    task = get_task(task_name)
    numel = sum(p.numel() for p in task.make_model(0).parameters())
    lr_s = f"{lr:g}" if lr is not None else f"{task.default_lr:g} (task default)"
    sync_epochs = max(1, round(n / tbs))
    diloco_epochs = max(1, round(n / (P * h * dbs)))
    print(f"\n## {task_name}: N = {n} samples; batch {bs}, lr {lr_s}, inner {task.default_optimizer}; "
          f"sync: target batch {tbs} x {sync_epochs} epochs = {tbs * sync_epochs}; "
          f"diloco: {P} peers x H={h} x {dbs} x {diloco_epochs} rounds = {P * h * dbs * diloco_epochs}, "
          f"{args.compression}, outer Nesterov SGD lr 0.7 momentum {mom:g}; lr warmup {warm} steps "
          f"(baseline and diloco inner); {load()}", flush=True)
    common = ["--batch-size", str(bs), "--seed", "0"] + (["--lr", str(lr)] if lr is not None else [])
    results: dict[str, Result] = {}
    runs = args.runs

    if "sync" in runs:
        print(f"  sync: {P} peers ...; {load()}", flush=True)
        r = run_p2ptrain_swarm("sync", task_name, P, common + [
            "--mode", "sync", "--target-batch-size", str(tbs), "--epochs", str(sync_epochs)],
            args.run_timeout, args.threads, logdir)
        results["sync"] = r
        print_peers(r)
    for name in ("diloco", "diloco-overlap"):
        if name not in runs:
            continue
        print(f"  {name}: {P} peers ...; {load()}", flush=True)
        r = run_p2ptrain_swarm(name, task_name, P, common + [
            "--batch-size", str(dbs), "--mode", "diloco", "--local-steps", str(h), "--compression", args.compression,
            "--outer-momentum", str(mom), "--inner-warmup-steps", str(warm),
            "--epochs", str(diloco_epochs)] + (["--overlap-outer"] if name == "diloco-overlap" else []),
            args.run_timeout, args.threads, logdir)
        results[name] = r
        print_peers(r)
    if "hivemind" in runs and args.hivemind_python:
        print(f"  hivemind.Optimizer: {P} peers ...; {load()}", flush=True)
        job = {"batch_size": bs, "lr": lr, "target_batch_size": tbs, "epochs": sync_epochs, "seed": 0,
               "matchmaking_time": args.hivemind_matchmaking_time, "averaging_timeout": 30.0}
        r = run_hivemind_swarm(args.hivemind_python, task_name, P, job, args.run_timeout, args.threads, logdir)
        results["hivemind"] = r
        print_peers(r)
    sims: list[Result] = []
    if args.simulate:
        # the swarm's settings; then one change at a time: the codec, the outer momentum
        for codec, momentum in ((args.compression, mom), ("none", mom), (args.compression, 0.0)):
            label = f"sim {codec} mom {momentum:g}"
            print(f"  simulated diloco ({label}) in this process ...; {load()}", flush=True)
            m, s, samples = simulate_diloco(task, P, dbs, lr, diloco_epochs, h, codec, outer_momentum=momentum,
                                            warmup_steps=warm)
            sims.append(Result(label, m, samples, s, s))
    if args.simulate_overlap:
        tau = h if args.overlap_steps is None else args.overlap_steps
        for label, overlap in (("sim blocking", None), (f"sim overlap tau={tau}", tau)):
            print(f"  simulated diloco ({label}) in this process ...; {load()}", flush=True)
            m, s, samples = simulate_diloco(task, P, dbs, lr, diloco_epochs, h, args.compression, outer_momentum=mom,
                                            warmup_steps=warm, overlap=overlap)
            sims.append(Result(label, m, samples, s, s))

    # the baselines last: evaluated at N and at every swarm's actual total
    base_n_steps = max(1, n // bs)
    actual = {name: r.samples for name, r in results.items() if r.samples}
    cap = 4 * base_n_steps  # a run that overshot N by more than 4x is compared at 4 N
    eval_steps = {base_n_steps} | {min(cap, max(1, round(s / bs))) for s in actual.values()} | {
        min(cap, max(1, round(s.samples / bs))) for s in sims}
    print(f"  baseline: 1 process, batch {bs}, up to {max(eval_steps)} steps ...; {load()}", flush=True)
    t0 = time.monotonic()
    evals, secs, _ = plain_loop(task, bs, lr, max(eval_steps), eval_steps, warmup_steps=warm)
    base_wall = time.monotonic() - t0
    steps_n = base_n_steps
    base = Result("baseline", evals[steps_n], steps_n * bs, secs * steps_n / max(eval_steps), base_wall,
                  steps_per_peer=steps_n)

    def ref_for(samples: int) -> dict[str, float]:
        return evals[min(max(1, round(samples / bs)), max(eval_steps))]

    rows: list[tuple[Result, dict[str, float] | None]] = [(base, None)]
    if "sync" in runs and not args.no_large_batch:
        steps = sync_epochs
        print(f"  baseline: 1 process, batch {tbs} (what sync computes), {steps} steps ...; {load()}", flush=True)
        t0 = time.monotonic()
        ev, s, m = plain_loop(task, tbs, lr, steps, set())
        rows.append((Result(f"baseline bs={tbs}", m, steps * tbs, s, time.monotonic() - t0), evals[steps_n]))
    for name in ("sync", "diloco", "diloco-overlap", "hivemind"):
        if name in results:
            r = results[name]
            rows.append((r, ref_for(r.samples) if r.samples else None))
    for s in sims:
        rows.append((s, ref_for(s.samples)))
    table(task_name, rows, numel, P)
    notes = [f"{name} trained {r.samples} samples ({(r.samples / n - 1) * 100:+.1f}% vs N): compared with the "
             f"baseline at {min(cap, round(r.samples / bs)) * bs} samples ({_fmt_metrics(ref_for(r.samples))})"
             for name, r in results.items() if r.samples and round(r.samples / bs) != base_n_steps]
    for name, codec in (("sync", "none"), ("diloco", args.compression)):
        r = results.get(name)
        if r is None or not r.peers or not r.bytes_sent:
            continue
        from p2ptrain.compression import get_codec

        rounds = sum(p["rounds"] for p in r.peers) / len(r.peers)
        ar = rounds * 2 * (P - 1) / P * get_codec(codec).encoded_nbytes(numel)
        fp32 = 2 * (P - 1) / P * 4 * numel * r.steps_per_peer
        notes.append(f"{name}: of the {fmt_bytes(r.bytes_sent)} sent per peer, the {codec} all-reduce of "
                     f"{rounds:.1f} rounds is ~{fmt_bytes(ar)} (ratio to fp32-every-step on that alone "
                     f"{fp32 / ar:.0f}x); the other {fmt_bytes(max(0.0, r.bytes_sent - ar))} "
                     f"({max(0.0, 1 - ar / r.bytes_sent) * 100:.0f}%) is other averaging (state rounds)")
    key, larger = metric_of(task_name)
    pairs = [(results.get("diloco"), results.get("diloco-overlap"))]
    if args.simulate_overlap:
        pairs.append((sims[-2], sims[-1]))
    for blocking, over in pairs:
        if blocking is not None and over is not None and key in blocking.metrics and key in over.metrics:
            a, b = blocking.metrics[key], over.metrics[key]
            ok = b / a >= 0.98 if larger else b / a <= 1.02
            notes.append(f"overlapped vs blocking rounds ({over.name} / {blocking.name}): final {key} "
                         f"{b:.4f} / {a:.4f} = {b / a:.4f} (2% {'ok' if ok else 'MISSED'})")
    for line in notes:
        print(f"  note: {line}")
    print(f"  logs: {logdir}", flush=True)


def _fmt_metrics(m: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in m.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["digits", "char_lm", "both"], default="digits")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--samples", type=int, help="total samples per run (default: digits 64000, char_lm 32000)")
    ap.add_argument("--batch-size", type=int, help="samples per local step (default: digits 32, char_lm 8)")
    ap.add_argument("--lr", type=float, help="inner learning rate, baseline included (default: the task's)")
    ap.add_argument("--target-batch-size", type=int, help="sync and hivemind (default: digits 512, char_lm 64)")
    ap.add_argument("--local-steps", type=int, default=50, help="DiLoCo H (default 50)")
    ap.add_argument("--diloco-batch-size", type=int,
                    help="samples per DiLoCo local step (default: digits 32, char_lm 2)")
    ap.add_argument("--warmup-steps", type=int,
                    help="linear lr warmup steps, baseline and DiLoCo inner (default: digits 0, char_lm 200)")
    ap.add_argument("--outer-momentum", type=float, help="DiLoCo outer momentum (default: digits 0.9, char_lm 0.8)")
    ap.add_argument("--compression", default="int8", help="DiLoCo pseudo-gradient codec (default int8)")
    ap.add_argument("--runs", nargs="*", default=["sync", "diloco", "hivemind"],
                    choices=["sync", "diloco", "diloco-overlap", "hivemind"],
                    help="swarm runs (default: all three; hivemind only with --hivemind-python); "
                         "the baseline always runs")
    ap.add_argument("--simulate", action="store_true", help="also DiLoCo simulated in-process (int8 and fp32)")
    ap.add_argument("--simulate-overlap", action="store_true",
                    help="also DiLoCo simulated with blocking and with overlapped outer rounds")
    ap.add_argument("--overlap-steps", type=int, metavar="TAU",
                    help="--simulate-overlap: inner steps before a round's average lands (default H)")
    ap.add_argument("--no-large-batch", action="store_true", help="skip the batch=target-batch-size baseline")
    ap.add_argument("--hivemind-python", metavar="PY", help="interpreter with hivemind 1.1.12 (numpy<2.4)")
    ap.add_argument("--hivemind-matchmaking-time", type=float, default=1.0,
                    help="hivemind.Optimizer matchmaking_time (default 1.0 s: loopback, 4 peers)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="seconds per swarm run before it is stopped")
    ap.add_argument("--logs", metavar="DIR", help="where the peers' logs go (default: a new temp dir)")
    args = ap.parse_args()
    if args.peers < 1:
        ap.error("--peers must be at least 1")
    logdir = args.logs or tempfile.mkdtemp(prefix="p2ptrain-convergence-")
    os.makedirs(logdir, exist_ok=True)
    # SIGTERM/SIGHUP become an exception, so that the finally below stops every child; SIGINT is
    # KeyboardInterrupt even where the shell started us with it ignored (a background job)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    try:
        for name in (["digits", "char_lm"] if args.task == "both" else [args.task]):
            bench_task(name, args, logdir)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every peer", file=sys.stderr)
        sys.exit(130)
    finally:
        CHILDREN.stop(grace=5.0)
    print(f"\ntotal {time.monotonic() - t0:.0f} s; {load()}")


if __name__ == "__main__":
    main()
