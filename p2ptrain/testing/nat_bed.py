"""A digits swarm of ``p2ptrain peer --json`` processes, one per host of a test bed, where the
hosts behind NAT routers (``Testbed(nat=...)``) are full members (``--behind-nat``) and the
public ones relay for them (``--relay``). What tests/test_netns_swarm.py and
benchmarks/nat_swarm.py run."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .netns import Testbed

__all__ = ["PeerRun", "train_swarm"]

Event = dict[str, Any]


class PeerRun:
    """One ``p2ptrain peer --json`` process in a host: its JSON events, read by a thread."""

    def __init__(self, tb: Testbed, host: int, argv: list[str]) -> None:
        self.host = host
        self._stderr = tempfile.TemporaryFile("w+")
        self.proc = tb.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._events: queue.Queue[Event | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self._events.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._events.put(None)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    def event(self, kind: str, timeout: float) -> Event:
        """The next event of ``kind``; RuntimeError (with the process's stderr) if none comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"host {self.host}: no {kind!r} event within {timeout} s; "
                                   f"stderr:\n{self.stderr()}") from None
            if event is None:
                raise RuntimeError(f"host {self.host}: exited ({self.proc.wait()}) before a {kind!r} event; "
                                   f"stderr:\n{self.stderr()}")
            if event.get("event") == kind:
                return event


def train_swarm(tb: Testbed, train: list[str], timeout: float = 200.0) -> list[tuple[Event, Event]]:
    """Train ``p2ptrain peer --json *train`` on every host of ``tb`` (host 0 first, the others
    bootstrapping from it; hosts behind NAT with ``--behind-nat``, the others with ``--relay``);
    each host's (started, done) events, in host order. Raises if a peer fails."""
    peer = [sys.executable, "-m", "p2ptrain", "peer", "--json", *train]

    def start(i: int, extra: list[str]) -> PeerRun:
        h = tb.hosts[i]
        mode = ["--behind-nat"] if i in tb.nat else ["--relay"]
        return PeerRun(tb, i, [*peer, *mode, "--listen", f"/ip4/{h.local_ip}/tcp/0", "--data-seed", str(i), *extra])

    first = start(0, [])
    started = [first.event("started", 90)]
    addr = started[0]["multiaddrs"][0]
    runs = [first, *(start(i, ["--bootstrap", addr]) for i in range(1, tb.n_hosts))]
    started += [r.event("started", 90) for r in runs[1:]]
    done = [r.event("done", timeout) for r in runs]
    for r in runs:
        if r.proc.wait(timeout=30) != 0:
            raise RuntimeError(f"host {r.host}: exit status {r.proc.returncode}; stderr:\n{r.stderr()}")
    return list(zip(started, done))
