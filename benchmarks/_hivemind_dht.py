#!/usr/bin/env python3
"""Baseline: hivemind's DHT, measured the way p2ptrain's DHT benchmark measures its own.

Usage (from the repository root, with a Python that has hivemind installed, e.g. a venv made by
``python3 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install hivemind==1.1.12 'numpy<2.4'``):

    V/bin/python benchmarks/_hivemind_dht.py --nodes 16 [--gets 500] [--kill-frac 0.3] --json

What it does:
  1. start N ``hivemind.DHT`` peers on 127.0.0.1 (each is its own process, plus its own
     ``p2pd`` Go daemon), every peer bootstrapped from the first one; ``start_s`` is the wall
     time of the whole start (sequential by default, as ``DHT(start=True, ...)`` does;
     ``--parallel-start`` launches peers 2..N at once, as hivemind's own tests do);
  2. store ``--keys`` keys (default 100), each from a random peer, expiring in 600 s;
  3. split the peers at random into ``ceil(kill_frac * N)`` victims and the survivors; the
     bootstrap peer is always a victim unless ``--spare-bootstrap``;
  4. do ``--gets`` sequential ``dht.get(key, latest=True)`` calls, each from a random survivor
     for a random stored key, timing each one; success = value found and equal to what was stored;
  5. crash the victims all at once (SIGKILL their p2pd daemons, then their DHT processes), wait
     ``--settle`` seconds, repeat step 4 from the same survivors;
  6. tear every peer down the same way and remove the daemons' unix socket files, leaving no
     process and no file behind (also on SIGINT / SIGTERM / an error).

With ``--json`` one JSON line goes to stdout:
  {"impl": "hivemind", "nodes": N, "start_s": ..., "get_p50_ms": ..., "get_p99_ms": ...,
   "get_success": ..., "after_kill": {"killed": n, "get_p50_ms": ..., "get_p99_ms": ...,
   "get_success": ...}, ...extra fields...}
If the start does not finish within ``--timeout`` seconds (default 300), the line has
``"error": "start timed out"``, ``start_s`` null and ``started`` (how many peers were up);
if free memory falls under ``--min-free-mb`` while starting (each peer costs ~60-100 MiB, so
N=256 does not fit in 24 GiB), ``"error": "start aborted: low memory (...)"``. The exit code
is 0 in both cases. Everything else (hivemind's logs, progress) goes to stderr.
Exit codes: 0 measured (or start timed out / aborted), 3 hivemind not importable, 1 anything
else, 130 interrupted.

Latency percentiles are over every get attempted (misses included; a get that hit
``--get-timeout`` counts with that time). hivemind's own logs are set to WARNING unless
HIVEMIND_LOGLEVEL is set in the environment. ``loadavg_1m_before`` / ``_after`` are in the
output because the numbers on a shared 2-core machine move a lot with its load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import signal
import sys
import threading
import time

MAIN_PID = os.getpid()


def _log(msg: str) -> None:
    print(f"[hivemind-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _percentile(sorted_vals, q):
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_vals:
        return None
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _children_of(pid: int):
    """PIDs whose parent is ``pid`` (read from /proc; empty where /proc is missing)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # the command name is in parentheses and may contain spaces: split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(name))
    return out


def _pid_gone(pid: int, zombie_ok: bool = True) -> bool:
    """True when ``pid`` no longer exists (or, with zombie_ok, is only a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return True
    fields = stat[stat.rfind(")") + 2 :].split()
    return zombie_ok and bool(fields) and fields[0] in ("Z", "X")


def _mem_available_mb():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Swarm:
    """The N peers, and everything needed to make sure none of them outlives the run."""

    def __init__(self, hivemind, dht_kwargs, min_free_mb=0):
        self.hivemind = hivemind
        self.min_free_mb = min_free_mb
        self.dht_kwargs = dht_kwargs
        self.peers = []  # hivemind.DHT objects, index = peer number
        self.dead = set()
        self.ready = set()  # peers whose DHT process reported ready
        self.daemon_pids = {}  # peer index -> p2pd pids seen under it
        self.socket_files = set()  # unix sockets of our daemons and their clients
        self._lock = threading.Lock()

    def _record_daemons(self, i):
        """Remember peer i's p2pd pid(s) and the unix socket files it and its client listen on."""
        d = self.peers[i]
        if d.pid is None:
            return
        kids = [pid for pid in _children_of(d.pid) if pid not in self.daemon_pids.get(i, [])]
        if not kids:
            return
        self.daemon_pids[i] = self.daemon_pids.get(i, []) + kids
        for pid in kids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            for arg in argv:
                # -listen=/unix/tmp/hivemind-p2pd-<uid>.sock; the client's is ...-p2pclient-<uid>.sock
                if arg.startswith("-listen=/unix/") and "-p2pd-" in arg:
                    path = arg[len("-listen=/unix"):]
                    self.socket_files.add(path)
                    self.socket_files.add(path.replace("-p2pd-", "-p2pclient-"))

    def _low_memory(self):
        """A reason to stop starting peers, or None."""
        free = _mem_available_mb()
        if self.min_free_mb and free is not None and free < self.min_free_mb:
            return f"start aborted: low memory (MemAvailable {free} MiB < --min-free-mb {self.min_free_mb})"
        return None

    def start(self, n, timeout, parallel):
        """Start n peers, each bootstrapped from the first.

        Returns (seconds, number_started, error): error is None, "start timed out", or
        "start aborted: low memory (...)"."""
        t0 = time.perf_counter()
        deadline = t0 + timeout
        elapsed = lambda: time.perf_counter() - t0  # noqa: E731
        first = self.hivemind.DHT(start=False, **self.dht_kwargs)
        self.peers.append(first)
        try:
            first.run_in_background(await_ready=True, timeout=max(0.1, deadline - time.perf_counter()))
        except Exception as e:  # TimeoutError, or the daemon failing to start
            if time.perf_counter() >= deadline:
                return elapsed(), 0, "start timed out"
            raise RuntimeError(f"first peer failed to start: {e!r}") from e
        self.ready.add(0)
        initial_peers = [str(m) for m in first.get_visible_maddrs()]
        started = 1
        for _ in range(n - 1):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return elapsed(), started, "start timed out"
            low = self._low_memory()
            if low:
                return elapsed(), started, low
            d = self.hivemind.DHT(initial_peers=initial_peers, start=False, **self.dht_kwargs)
            self.peers.append(d)
            if parallel:  # as hivemind's own tests do: launch all, then wait for all
                d.run_in_background(await_ready=False)
                continue
            try:
                d.run_in_background(await_ready=True, timeout=remaining)
            except Exception as e:
                if time.perf_counter() >= deadline:
                    return elapsed(), started, "start timed out"
                raise RuntimeError(f"peer {started} failed to start: {e!r}") from e
            self.ready.add(started)
            started += 1
            if started % 16 == 0:
                _log(f"started {started}/{n} peers ({elapsed():.1f} s)")
        if parallel:
            for i in range(1, len(self.peers)):
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return elapsed(), started, "start timed out"
                try:
                    self.peers[i].wait_until_ready(timeout=remaining)
                except Exception as e:
                    if time.perf_counter() >= deadline:
                        return elapsed(), started, "start timed out"
                    raise RuntimeError(f"peer {i} failed to start: {e!r}") from e
                self.ready.add(i)
                started += 1
        t = elapsed()
        for i in range(len(self.peers)):
            self._record_daemons(i)
        return t, started, None

    def kill_many(self, indices, reap_wait=2.0):
        """Crash peers at once: SIGKILL their p2pd daemons, let the DHT processes reap them
        (so no zombie is handed to init; at most ``reap_wait`` s), then SIGKILL the DHT processes."""
        indices = [i for i in indices if i not in self.dead and self.peers[i].pid is not None]
        for i in indices:
            if i not in self.ready:  # still starting: freeze it so it cannot spawn p2pd after we look
                try:
                    os.kill(self.peers[i].pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
        daemons = []
        for i in indices:
            self._record_daemons(i)
            daemons += self.daemon_pids.get(i, [])
        for pid in daemons:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t_end = time.perf_counter() + reap_wait
        while daemons and time.perf_counter() < t_end and not all(_pid_gone(p, zombie_ok=False) for p in daemons):
            time.sleep(0.01)
        for i in indices:
            try:
                self.peers[i].kill()
            except Exception:
                pass
        for i in indices:
            self.peers[i].join(5)
            self.dead.add(i)

    def shutdown_all(self):
        """Tear every peer down (the same SIGKILL as kill_many: quick and deterministic on a
        loaded 2-core machine, where hivemind's graceful shutdown of 100+ peers needs tens of
        seconds), then make sure no daemon and no socket file of ours is left behind."""
        with self._lock:
            self.kill_many(range(len(self.peers)))
            for pids in self.daemon_pids.values():  # daemons orphaned some other way
                for pid in pids:
                    if not _pid_gone(pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            # zombies handed to init (from peers killed while starting) are reaped by it: wait up to 5 s
            t_end = time.perf_counter() + 5.0
            all_daemons = [pid for pids in self.daemon_pids.values() for pid in pids]
            while time.perf_counter() < t_end and not all(_pid_gone(p, zombie_ok=False) for p in all_daemons):
                time.sleep(0.05)
            for path in self.socket_files:  # a killed p2pd / client does not remove its unix socket
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _get_phase(swarm, keys, values, getter_ids, n_gets, get_timeout, budget_s, rng, latest=True):
    """n_gets sequential gets; returns dict with latencies in ms and success fraction."""
    lat_ms = []
    ok = 0
    timeouts = 0
    errors = 0
    t_phase = time.perf_counter()
    for _ in range(n_gets):
        if time.perf_counter() - t_phase > budget_s:
            break
        i = rng.choice(getter_ids)
        k = rng.randrange(len(keys))
        d = swarm.peers[i]
        t0 = time.perf_counter()
        try:
            fut = d.get(keys[k], latest=latest, return_future=True)
            res = fut.result(timeout=get_timeout)
            dt = time.perf_counter() - t0
            if res is not None and res.value == values[k]:
                ok += 1
        except Exception as e:  # concurrent.futures.TimeoutError or an error from the peer
            dt = time.perf_counter() - t0
            if "Timeout" in type(e).__name__:
                timeouts += 1
                dt = max(dt, get_timeout)
            else:
                errors += 1
        lat_ms.append(dt * 1000.0)
    done = len(lat_ms)
    s = sorted(lat_ms)
    return {
        "get_p50_ms": round(_percentile(s, 50), 3) if s else None,
        "get_p99_ms": round(_percentile(s, 99), 3) if s else None,
        "get_success": round(ok / done, 4) if done else 0.0,
        "gets_done": done,
        "get_timeouts": timeouts,
        "get_errors": errors,
        "phase_s": round(time.perf_counter() - t_phase, 3),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description="hivemind DHT baseline for p2ptrain's DHT benchmark")
    ap.add_argument("--nodes", type=int, required=True, help="number of DHT peers (>= 2)")
    ap.add_argument("--gets", type=int, default=500, help="gets per phase (default 500)")
    ap.add_argument("--keys", type=int, default=100, help="keys stored (default 100)")
    ap.add_argument("--kill-frac", type=float, default=0.3, help="fraction of peers to SIGKILL (default 0.3)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to wait after the kill (default 5)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="give up starting the peers after this many seconds (default 300)")
    ap.add_argument("--min-free-mb", type=int, default=3072,
                    help="stop starting peers when MemAvailable drops below this (default 3072; 0 = off); "
                         "each peer costs ~60-100 MiB, mostly its p2pd daemon")
    ap.add_argument("--get-timeout", type=float, default=30.0, help="limit for one get, seconds (default 30)")
    ap.add_argument("--phase-budget", type=float, default=120.0,
                    help="stop a get phase early after this many seconds (default 120)")
    ap.add_argument("--parallel-start", action="store_true",
                    help="start peers 2..N without waiting for each (as hivemind's own tests do)")
    ap.add_argument("--any-value", action="store_true",
                    help="get(latest=False): stop at the first value found (default: latest=True)")
    ap.add_argument("--spare-bootstrap", action="store_true", help="never kill the first (bootstrap) peer")
    ap.add_argument("--seed", type=int, default=None, help="random seed (peer choice, keys)")
    ap.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be >= 2")
    if not 0.0 <= args.kill_frac < 1.0:
        ap.error("--kill-frac must be in [0, 1)")

    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    try:
        import hivemind  # noqa: F401
        from hivemind.utils import get_dht_time  # hivemind.get_dht_time does not exist in 1.1.x
    except ImportError as e:
        print(f"hivemind is not importable by {sys.executable}: {e}", file=sys.stderr)
        return 3

    # one process and a few pipes per peer: make sure the fd limit is not the bottleneck
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ValueError, OSError):
        pass

    rng = random.Random(args.seed)
    n = args.nodes
    n_kill = min(n - 1, math.ceil(args.kill_frac * n)) if args.kill_frac > 0 else 0

    # loopback only; NAT port mapping off (it would probe the LAN gateway with UPnP / NAT-PMP)
    dht_kwargs = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    swarm = Swarm(hivemind, dht_kwargs, min_free_mb=args.min_free_mb)

    def _on_signal(signum, frame):
        if os.getpid() != MAIN_PID:  # inherited by a forked peer: behave as if no handler were set
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _on_signal)

    result = {"impl": "hivemind", "nodes": n, "hivemind_version": getattr(hivemind, "__version__", None),
              "cpus": os.cpu_count(), "loadavg_1m_before": _loadavg()}
    try:
        _log(f"starting {n} peers ({'parallel' if args.parallel_start else 'sequential'} start, "
             f"timeout {args.timeout:.0f} s)")
        start_s, started, start_error = swarm.start(n, args.timeout, args.parallel_start)
        result["start_mode"] = "parallel" if args.parallel_start else "sequential"
        result["get_latest"] = not args.any_value
        if start_error:
            _log(f"{start_error} after {start_s:.1f} s with {started}/{n} peers up")
            result.update({"start_s": None, "error": start_error, "started": started,
                           "start_elapsed_s": round(start_s, 3), "start_timeout_s": args.timeout})
            return _emit(result, args.json, 0)
        result["start_s"] = round(start_s, 3)
        _log(f"{n} peers up in {start_s:.2f} s")

        # store keys from random peers
        tag = "%08x" % rng.getrandbits(32)
        keys = [f"hmbench-{tag}-key-{k}" for k in range(args.keys)]
        values = [f"value-{k}-{rng.getrandbits(64):016x}" for k in range(args.keys)]
        t0 = time.perf_counter()
        stores_ok = 0
        storers = set()
        for k in range(args.keys):
            i = rng.randrange(n)
            storers.add(i)
            try:
                ok = swarm.peers[i].store(keys[k], values[k],
                                          expiration_time=get_dht_time() + 600)
            except Exception as e:
                _log(f"store {k} from peer {i} failed: {e!r}")
                ok = False
            stores_ok += bool(ok)
        result["stores_ok"] = stores_ok
        result["keys"] = args.keys
        result["store_s"] = round(time.perf_counter() - t0, 3)
        _log(f"stored {stores_ok}/{args.keys} keys in {result['store_s']:.2f} s")
        if stores_ok == 0:
            raise RuntimeError("no store succeeded: nothing to measure")

        # victims (a mix: the bootstrap peer unless spared, key-storing peers and others) / survivors
        pool = list(range(1, n)) if args.spare_bootstrap else list(range(n))
        if not args.spare_bootstrap and n_kill > 0:
            victims = [0] + rng.sample(range(1, n), n_kill - 1)
        else:
            victims = rng.sample(pool, n_kill)
        victim_set = set(victims)
        survivors = [i for i in range(n) if i not in victim_set]

        before = _get_phase(swarm, keys, values, survivors, args.gets, args.get_timeout, args.phase_budget, rng,
                            latest=not args.any_value)
        result.update(before)
        _log(f"gets: p50 {before['get_p50_ms']} ms, p99 {before['get_p99_ms']} ms, "
             f"success {before['get_success']} ({before['gets_done']} gets)")

        t0 = time.perf_counter()
        swarm.kill_many(victims)
        kill_s = time.perf_counter() - t0
        _log(f"killed {len(victims)} peers (SIGKILL) in {kill_s:.2f} s; settling {args.settle:.0f} s")
        time.sleep(args.settle)
        after = _get_phase(swarm, keys, values, survivors, args.gets, args.get_timeout, args.phase_budget, rng,
                            latest=not args.any_value)
        after = {"killed": len(victims), **after, "kill_method": "SIGKILL (p2pd daemons, then DHT processes)",
                 "killed_bootstrap": 0 in victim_set,
                 "killed_storers": len(victim_set & storers), "settle_s": args.settle}
        result["after_kill"] = after
        _log(f"after kill: p50 {after['get_p50_ms']} ms, p99 {after['get_p99_ms']} ms, "
             f"success {after['get_success']} ({after['gets_done']} gets)")
        return _emit(result, args.json, 0)
    except KeyboardInterrupt as e:
        _log(f"interrupted ({e}); shutting peers down")
        return 130
    finally:
        t0 = time.perf_counter()
        swarm.shutdown_all()
        _log(f"all peers shut down in {time.perf_counter() - t0:.1f} s")


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _emit(result, as_json, code):
    result["loadavg_1m_after"] = _loadavg()  # this and _before flag runs on a busy machine
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        for k, v in result.items():
            print(f"{k}: {v}", flush=True)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - one line, then a non-zero exit
        print(f"hivemind DHT benchmark failed: {e!r}", file=sys.stderr)
        sys.exit(1)
