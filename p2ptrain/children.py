"""Child processes that must not outlive their parent (swarm peers, test and benchmark children)."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG): belt and braces
    with the stdin-EOF watch, so no test or benchmark child outlives the run that started it."""
    if sys.platform == "linux":
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        except Exception:
            pass
