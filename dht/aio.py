"""Small asyncio helpers shared by the DHT and the trainer.

``wait_event`` exists because ``asyncio.wait_for`` on Python 3.11 can swallow a cancellation that
arrives in the same loop iteration as the awaited event (CPython gh-86296, fixed in 3.12): the
cancelled task then runs on, and a ``close()`` that cancels and awaits it hangs forever. It bit our
progress tracker's refresh loop; ``asyncio.timeout`` has no such race.
"""

from __future__ import annotations

import asyncio


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
