"""Shared fixtures."""

from __future__ import annotations

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
