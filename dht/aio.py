"""Small asyncio helpers shared by the DHT and the trainer.

``wait_event`` exists because ``asyncio.wait_for`` on Python 3.11 can swallow a cancellation that
arrives in the same loop iteration as the awaited event (CPython gh-86296, fixed in 3.12): the
cancelled task then runs on, and a ``close()`` that cancels and awaits it hangs forever. It bit our
progress tracker's refresh loop; ``asyncio.timeout`` has no such race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until every one has finished, consuming its result or error:
    how an owner's ``close()`` ends the background work it started (nothing is left running, and
    asyncio reports no "exception was never retrieved")."""
    pending = list(tasks)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds (None: no limit).

    Returns whether it is set; a cancellation always propagates.
    """
    if event.is_set():
        return True
    if timeout is None:
        await event.wait()
        return True
    if timeout <= 0:
        return False
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
