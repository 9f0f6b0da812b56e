"""Shared fixtures."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Callable

import pytest


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


@pytest.fixture(autouse=True)
def _isolated_data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers a test starts (in-process or as subprocesses) keep their peer cache and default
    checkpoint store in a fresh directory: never the user's ~/.cache, and never a cache that an
    earlier test filled, through which a test expecting a dead bootstrap to fail could join
    another test's live peer instead."""
    monkeypatch.setenv("P2PTRAIN_DATA_DIR", str(tmp_path_factory.mktemp("data")))
