"""Short GIL waits for a burst of many small torch calls from a background thread.

Every torch op called from Python drops the GIL and must take it back when it returns. While
another thread of the peer runs Python (the event loop moving an all-reduce, the training loop),
taking it back waits until that thread is asked to let go, after ``sys.getswitchinterval()``
(5 ms by default). A state snapshot makes several torch calls per tensor, so beside one busy
Python thread it waits far longer than it computes. ``short_gil_waits`` lowers the interval for the
duration of such a burst and puts it back after (nesting and concurrent use from several threads are
counted). The cost while it is on: threads that share the GIL are switched more often, which is
negligible next to the waits it removes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["short_gil_waits"]

#: the switch interval while a burst runs (seconds)
BURST_SWITCH_INTERVAL = 2e-5

_lock = threading.Lock()
_active = 0
_saved = 0.0


@contextmanager
def short_gil_waits(interval: float = BURST_SWITCH_INTERVAL) -> Iterator[None]:
    """Run the block with ``sys.setswitchinterval(min(current, interval))``."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, interval))
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                sys.setswitchinterval(_saved)
