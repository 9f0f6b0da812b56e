"""A child process that prints JSON events, one per line (``p2ptrain peer --json``, test workers):
a thread queues them, a test waits for the one it needs; its stderr is kept for failure messages."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["EventProcess", "descendants"]


class EventProcess:
    """``argv`` started in a session of its own; its JSON stdout lines arrive in ``events``."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []  # the events wait_for took, in order
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 90.0) -> dict[str, Any]:
        """The next event for which ``pred`` holds (AssertionError, with the stderr's tail, after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such event in {timeout} s; stderr: {''.join(self.stderr)[-3000:]}") from None
            self.seen.append(event)
            if pred(event):
                return event

    def kill(self) -> None:
        """SIGKILL the process and every process under it (those in sessions of their own too); reap it."""
        if self.proc.poll() is None:
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """The pids of every live process under ``pid`` (Linux: read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        out += kids
        frontier = kids
    return out
