"""``TaskGroup``: the one owner of an object's background tasks.

An object that starts tasks spawns them in its group and closes the group in its own ``close()``:
every task is then cancelled and awaited, none outlives its owner, and an error no one awaits is
logged when it happens instead of asyncio's "exception was never retrieved" at garbage collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["TaskGroup"]


class TaskGroup:
    """Tasks owned together: ``spawn`` starts one, ``close`` cancels them all and waits until they
    have ended. A task leaves the group when it finishes; a closed group starts no more tasks.

    Unlike ``asyncio.TaskGroup`` one task's failure leaves the others running: the error is
    logged (``log``, at ERROR) unless the spawner said it reads the task's outcome itself.
    """

    def __init__(self, name: str = "task group", *, log: logging.Logger | None = None,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.name = name
        self._log = log or logging.getLogger("dht.tasks")
        self._loop = loop
        self._tasks: set[asyncio.Task] = set()
        self._cancelled: set[asyncio.Task] = set()  # cancelled once: a second cancel would cut their cleanup short
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None,
              awaited: bool = False) -> asyncio.Task[T]:
        """Run ``coro`` as a task of this group. ``awaited``: the caller reads the task's result or
        error itself (so the group does not log it). RuntimeError once the group is closed."""
        if self._closed:
            coro.close()  # never started: no "coroutine was never awaited" warning
            raise RuntimeError(f"{self.name} is closed: it starts no more tasks")
        loop = self._loop or asyncio.get_running_loop()
        task = loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._forget if awaited else self._finished)
        return task

    def _forget(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._cancelled.discard(task)

    def _finished(self, task: asyncio.Task) -> None:
        self._forget(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._log.error("%s: task %s failed", self.name, task.get_name(), exc_info=exc)

    @contextlib.contextmanager
    def adopt(self) -> Iterator[None]:
        """The running task (one this group did not spawn, e.g. a stream handler) belongs to the
        group until the block exits: ``close`` cancels it. Once closed, it is cancelled at once."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        if self._closed:
            task.cancel()
            yield
            return
        self._tasks.add(task)
        try:
            yield
        finally:
            self._forget(task)

    def cancel(self) -> None:
        """Cancel every task of the group now, without waiting (for an owner whose close is not async).
        Each task is cancelled once: its cleanup then runs to its end."""
        self._cancel(list(self._tasks))

    def _cancel(self, tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            if task not in self._cancelled:
                task.cancel()
                self._cancelled.add(task)

    async def close(self) -> None:
        """Start no more tasks, cancel every one and wait until all have ended. Idempotent."""
        self._closed = True
        me = asyncio.current_task()
        while pending := [t for t in self._tasks if t is not me]:
            self._cancel(pending)
            await asyncio.gather(*pending, return_exceptions=True)
            for task in pending:
                self._forget(task)

    async def __aenter__(self) -> TaskGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
