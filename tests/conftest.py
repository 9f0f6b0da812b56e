"""Shared fixtures."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from dht import Host, Limits


def _child_pids() -> set[int]:
    """Live (not yet reaped) child processes of this test process."""
    try:
        import psutil

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except ImportError:
        pass
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # field 4 is the parent pid
                out.add(int(entry))
    return out


@pytest.fixture
def child_pids() -> Callable[[], set[int]]:
    """A function listing this process's live children: multi-process tests compare it before
    and after, to prove they left no process behind."""
    return _child_pids


@pytest.fixture
def dhts():
    """``dhts()``: a new ``p2ptrain.DHT`` on loopback, joined through the first one made; all
    closed at the end (newest first)."""
    from p2ptrain import DHT

    made: list[DHT] = []

    def new() -> DHT:
        made.append(DHT([str(made[0].multiaddrs[0])] if made else []))
        return made[-1]

    yield new
    for node in reversed(made):
        node.close()


@pytest.fixture
async def loop_errors():
    """Collect what the event loop reports (e.g. "Task exception was never retrieved"); the test
    fails if anything was: a swallowed error in a background task is a bug, not noise."""
    loop = asyncio.get_running_loop()
    reports: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    try:
        yield reports
        gc.collect()  # unretrieved exceptions are reported when their future is collected
    finally:
        loop.set_exception_handler(previous)
    assert [(c.get("message"), repr(c.get("exception"))) for c in reports] == []


@pytest.fixture
async def make_host():
    """``await make_host(limits=None, listen=("127.0.0.1", 0), **kw)``: a started ``dht.Host`` that
    answers an "echo" method with its arguments; all closed at the end of the test."""
    from dht import Host, Identity

    hosts: list[Host] = []

    async def make(limits: Limits | None = None, listen=("127.0.0.1", 0), **kw) -> Host:
        host = Host(Identity(), listen, limits=limits, **kw)
        await host.start()
        hosts.append(host)
        echo = lambda _conn, args: _echo(args)  # noqa: E731
        host.on_request("echo", echo)
        return host

    yield make
    for host in hosts:
        await host.close()


async def _echo(args):
    return args


@pytest.fixture(autouse=True)
def _isolated_data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers a test starts (in-process or as subprocesses) keep their peer cache and default
    checkpoint store in a fresh directory: never the user's ~/.cache, and never a cache that an
    earlier test filled, through which a test expecting a dead bootstrap to fail could join
    another test's live peer instead."""
    monkeypatch.setenv("P2PTRAIN_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    # `p2ptrain peer` listens on every interface by default; the suite's peers stay on loopback
    # (a test that means another address passes --listen, which wins over the variable)
    monkeypatch.setenv("P2PTRAIN_LISTEN", "/ip4/127.0.0.1/tcp/0")


class PeerProcess:
    """One ``p2ptrain peer --json`` process, driven as a user would: a thread turns its stdout into
    events, another keeps its stderr (both pipes are always drained, so a chatty peer never blocks
    on a full pipe)."""

    def __init__(self, args: list[str], *, name: str = "peer", cwd: Any = None, env: dict[str, str] | None = None):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "peer", "--json", *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []  # events a wait_for took off the queue
        self.latest: dict[str, dict[str, Any]] = {}  # the newest event of each kind, waited for or not
        self._stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and "event" in event:
                self.latest[event["event"]] = event
                self.events.put(event)

    def errors(self, tail: int | None = 2000) -> str:
        """The peer's stderr: its last ``tail`` characters (for assertion messages), or all of it."""
        text = "".join(self._stderr)
        return text if tail is None else text[-tail:]

    def wait_for(self, what: str | Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        """The next event of kind ``what`` (or matching the predicate ``what``); fails at once if the
        process exits without one, else after ``timeout`` s."""
        matches = (lambda e: e["event"] == what) if isinstance(what, str) else what
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._reader.join(5)  # its last lines may still be in the pipe: read them first
                    if self.events.empty():
                        break
                continue
            self.seen.append(event)
            if matches(event):
                return event
        rc = self.proc.poll()
        why = (f"exited with code {rc} before a matching event" if rc is not None
               else f"no matching event within {timeout} s")
        raise AssertionError(f"{self.name} (pid {self.proc.pid}): {why}; last events {self.seen[-3:]}; "
                             f"stderr {self.errors()}")

    def done(self, timeout: float) -> dict[str, Any]:
        """The ``done`` event, and a clean exit after it."""
        event = self.wait_for("done", timeout)
        assert self.proc.wait(timeout=30) == 0, self.errors()
        return event

    def stop(self) -> int:
        """Ctrl+C, as a user would; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def peer_process() -> Iterator[Callable[..., PeerProcess]]:
    """Start ``p2ptrain peer --json`` processes (``peer_process(*args, name=, cwd=, env=)``); every one
    is killed at the end of the test, and none may outlive it."""
    before = _child_pids()
    started: list[PeerProcess] = []

    def start(*args: str, **kw: Any) -> PeerProcess:
        started.append(PeerProcess(list(args), **kw))
        return started[-1]

    yield start
    for p in started:
        p.kill()
    assert _child_pids() <= before, "a peer process outlived the test"
