"""`p2ptrain peer` with instrumentation, for benchmarks/utilisation.py (not a public tool).

    python benchmarks/_peer_instr.py peer --json --compute-delay 0.05 ...   # same flags as p2ptrain

Runs exactly the CLI path (``p2ptrain.cli.main`` -> ``run_peer``), with the optimizer class that
``run_peer`` builds replaced by a subclass that only observes; the subclass prints extra JSON lines
on stdout next to the CLI's own events (all with a ``"t"`` = ``time.time()`` stamp):

- ``{"event": "epoch", "epoch": E, "samples": S, "cpu": C}``: this peer's ``opt.epoch`` became ``E``
  at the end of a ``step()``; ``S`` = samples it processed so far, ``C`` = its CPU seconds so far.
- ``{"event": "round", ...}``: one averaging decision: when the peer decided the epoch was over
  (``t_enter``), what it saw (estimated swarm samples, peers, ready peers, its own samples), how long
  ``step()`` paused for it, and the averaging result (matchmaking / all-reduce seconds, group size,
  total weight = samples of the group). A round that runs on while training goes on (delayed
  updates, overlapped outer rounds) sends its result in a ``{"event": "result", ...}`` line of its
  own: waiting for it here would put the round's time inside ``step()``.
- ``{"event": "steps", ...}``: every epoch, seconds this peer spent inside ``step()`` vs outside.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

_lock = threading.Lock()


def _emit(obj: dict) -> None:
    line = json.dumps(obj)
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wait_result(rec: dict) -> None:
    """The round's done-callback runs on the loop thread, possibly just after ``result()`` returned
    in the training thread: give it a moment to fill in the averaging figures."""
    deadline = time.monotonic() + 1.0
    while "t_avg_done" not in rec and time.monotonic() < deadline:
        time.sleep(0.0005)


def _install() -> None:
    import p2ptrain.run
    from p2ptrain.optim import DecentralizedOptimizer

    class Instrumented(DecentralizedOptimizer):
        def __init__(self, *args, **kwargs):
            self._i_round: dict | None = None
            self._i_in_step = 0.0
            self._i_out_step = 0.0
            self._i_last_return: float | None = None
            self._i_steps = 0
            super().__init__(*args, **kwargs)
            _emit({"event": "epoch", "epoch": self.epoch, "samples": 0, "cpu": _cpu(), "t": time.time(),
                   "init": True})

        def step(self, closure=None, batch_size=None):  # noqa: D102
            t0 = time.perf_counter()
            if self._i_last_return is not None:
                self._i_out_step += t0 - self._i_last_return
            before = self.epoch
            out = super().step(closure, batch_size)
            t1 = time.perf_counter()
            self._i_in_step += t1 - t0
            self._i_last_return = t1
            self._i_steps += 1
            if self.epoch != before:
                now = time.time()
                _emit({"event": "steps", "epoch": before, "in_step": self._i_in_step, "out_step": self._i_out_step,
                       "steps": self._i_steps, "t": now})
                self._i_in_step = self._i_out_step = 0.0
                self._i_steps = 0
                _emit({"event": "epoch", "epoch": self.epoch, "samples": self.stats.samples_total, "cpu": _cpu(),
                       "t": now, "state_loads": self.stats.state_loads})
            return out

        # ---- sync: the decision to end an epoch and its round
        def _end_sync_epoch(self, view):
            t_enter = time.time()
            p0 = time.perf_counter()
            self._i_round = {"event": "round", "mode": "sync", "epoch": self.epoch, "t_enter": t_enter,
                             "local": self.local_samples, "est_samples": view.samples, "peers": view.num_peers,
                             "ready_seen": len(view.ready), "reached": view.reached, "behind": len(view.behind),
                             "sps_local": self._sps, "sps_swarm": view.sps}
            rec = self._i_round
            super()._end_sync_epoch(view)
            rec["pause"] = time.perf_counter() - p0  # time step() spent in here (incl. applying a pending round)
            rec["t_exit"] = time.time()
            if not self.delay_updates:  # else its averaging result comes in a separate "result" line
                _wait_result(rec)
            _emit(rec)

        # ---- diloco
        def _outer_step(self, view):
            t_enter = time.time()
            p0 = time.perf_counter()
            self._i_round = {"event": "round", "mode": "diloco", "epoch": self.epoch, "t_enter": t_enter,
                             "local": self.local_samples, "local_steps_done": self._local_steps_done,
                             "peers": view.num_peers, "ready_seen": len(view.ready), "behind": len(view.behind),
                             "sps_local": self._sps, "sps_swarm": view.sps}
            rec = self._i_round
            super()._outer_step(view)
            rec["pause"] = time.perf_counter() - p0
            rec["t_exit"] = time.time()
            if not self.overlap_outer:  # (overlapped: the round is still running; its result comes apart)
                _wait_result(rec)
            _emit(rec)

        def _maybe_average_state(self, epoch):  # periodic parameter/state averaging, where the optimizer has it
            t0 = time.perf_counter()
            rounds0 = self.stats.state_rounds
            out = super()._maybe_average_state(epoch)
            dt = time.perf_counter() - t0
            if self.stats.state_rounds != rounds0 or dt > 0.01:
                _emit({"event": "state_round", "epoch": epoch, "seconds": dt, "averaged": bool(out), "t": time.time()})
            return out

        def _average(self, epoch, samples, view):
            t_start = time.time()
            fut = super()._average(epoch, samples, view)
            rec = self._i_round if self._i_round is not None and self._i_round.get("epoch") == epoch else None
            delayed = (self.delay_updates and self.mode == "sync") or self.overlap_outer  # (a "result" line)
            expected = view.num_peers + sum(1 for p in view.behind if p.epoch == epoch - 1)

            def done(f):
                info = {"t_avg_start": t_start, "t_avg_done": time.time(), "expected": expected}
                try:
                    r = f.result()
                except BaseException as e:  # noqa: BLE001
                    info["error"] = f"{type(e).__name__}: {e}"
                    r = None
                if r is None and "error" not in info:
                    info["skipped"] = True
                if r is not None:
                    info.update(group=r.group_size, mm=r.matchmaking_s, ar=r.allreduce_s, total=r.total_s,
                                weight=r.weight_total, not_averaged=len(r.not_averaged), failed=len(r.failed),
                                sent=r.bytes_sent)
                    info["mm_stats"] = dict(self.averager.matchmaker.last_stats)
                if delayed or rec is None:
                    _emit({"event": "result", "epoch": epoch, "t": time.time(), **info})
                else:
                    rec.update(info)

            fut.add_done_callback(done)
            return fut

    p2ptrain.run.DecentralizedOptimizer = Instrumented


def main() -> int:
    sys.path.insert(0, os.getcwd())
    _install()
    from p2ptrain.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
