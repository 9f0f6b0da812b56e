"""Processes in test bed hosts that print JSON lines (:class:`Proc`), and a digits swarm of
``p2ptrain peer --json`` processes, one per host, where the hosts behind NAT routers
(``Testbed(nat=...)``) are full members (``--behind-nat``) and the public ones relay for them
(``--relay``): what tests/test_netns_swarm.py and benchmarks/nat_swarm.py run."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .netns import Testbed

__all__ = ["Proc", "train_swarm"]

Event = dict[str, Any]


class Proc:
    """A process inside a test bed host whose stdout JSON lines are queued by a reader thread."""

    def __init__(self, tb: Testbed, host: int, argv: list[str]) -> None:
        self.host = host
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = tb.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[Event | None] = queue.Queue()
        self.seen: list[Event] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.lines.put(None)

    def err(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]

    def wait_for(self, predicate: Callable[[Event], Any], timeout: float) -> Event:
        """The next line that ``predicate`` accepts; AssertionError (with the process's stderr) if
        none comes within ``timeout`` seconds or the process ends first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"host {self.host}, pid {self.proc.pid}: nothing matching within {timeout} s; "
                                     f"last {self.seen[-3:]}; stderr:\n{self.err()}") from None
            if msg is None:
                raise AssertionError(f"host {self.host}, pid {self.proc.pid} exited ({self.proc.wait()}); "
                                     f"last {self.seen[-3:]}; stderr:\n{self.err()}")
            self.seen.append(msg)
            if predicate(msg):
                return msg


def train_swarm(tb: Testbed, train: list[str], timeout: float = 200.0, start_timeout: float = 90.0,
                clients: Iterable[int] = (),
                per_host: Mapping[int, list[str]] | None = None) -> list[tuple[Event, Event]]:
    """Train ``p2ptrain peer --json *train`` on every host of ``tb`` (host 0 first, the others
    bootstrapping from it; hosts behind NAT with ``--behind-nat``, the others with ``--relay``;
    hosts in ``clients`` as a client-mode trainer, ``agent train --client``, which listens nowhere;
    ``per_host[i]``: more flags for host i);
    each host's (started, done) events, in host order. Raises if a peer fails. ``start_timeout``:
    seconds each peer may take to start (importing torch on a loaded machine is most of it)."""
    peer = [sys.executable, "-m", "p2ptrain", "peer", "--json", *train]
    client = [sys.executable, "-m", "p2ptrain.testing.agent", "train", "--client", *train]
    clients = frozenset(clients)

    def start(i: int, extra: list[str]) -> Proc:
        h = tb.hosts[i]
        extra = [*extra, *(per_host or {}).get(i, [])]
        if i in clients:
            return Proc(tb, i, [*client, "--data-seed", str(i), *extra])
        mode = ["--behind-nat"] if i in tb.nat else ["--relay"]
        return Proc(tb, i, [*peer, *mode, "--listen", f"/ip4/{h.local_ip}/tcp/0", "--data-seed", str(i), *extra])

    def event(p: Proc, kind: str, within: float) -> Event:
        return p.wait_for(lambda e: e.get("event") == kind, within)

    first = start(0, [])
    started = [event(first, "started", start_timeout)]
    addr = started[0]["multiaddrs"][0]
    runs = [first, *(start(i, ["--bootstrap", addr]) for i in range(1, tb.n_hosts))]
    started += [event(r, "started", start_timeout) for r in runs[1:]]
    done = [event(r, "done", timeout) for r in runs]
    for r in runs:
        if r.proc.wait(timeout=120) != 0:  # (leaving takes a while on a loaded machine)
            raise AssertionError(f"host {r.host}: exit status {r.proc.returncode}; stderr:\n{r.err()}")
    return list(zip(started, done))
