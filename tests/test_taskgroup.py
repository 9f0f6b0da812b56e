"""dht.TaskGroup: the owner of background tasks (spawn, close, adopt, errors logged)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dht import TaskGroup

pytestmark = pytest.mark.timeout(10)


async def test_close_cancels_and_awaits_every_task() -> None:
    group = TaskGroup()
    started, ended = asyncio.Event(), []

    async def forever(i: int) -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that itself awaits: close() must wait for it
            ended.append(i)

    tasks = [group.spawn(forever(i)) for i in range(3)]
    await started.wait()
    await group.close()
    assert sorted(ended) == [0, 1, 2]
    assert all(t.cancelled() for t in tasks)
    assert len(group) == 0


async def test_async_with_closes_the_group() -> None:
    async with TaskGroup() as group:
        task = group.spawn(asyncio.Event().wait())
        await asyncio.sleep(0)
    assert task.cancelled() and group.closed


async def test_finished_tasks_leave_the_group() -> None:
    group = TaskGroup()
    release = asyncio.Event()

    async def wait() -> int:
        await release.wait()
        return 7

    done = group.spawn(wait())
    held = group.spawn(asyncio.Event().wait())
    assert len(group) == 2
    release.set()
    assert await done == 7
    await asyncio.sleep(0)  # the done callback runs in the next loop iteration
    assert list(group) == [held]
    await group.close()


async def test_close_is_idempotent_and_spawn_after_close_is_refused() -> None:
    group = TaskGroup("my service")
    await group.close()
    await group.close()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="my service is closed"):
        group.spawn(coro)
    assert coro.cr_frame is None  # closed, not left to warn "never awaited"


async def test_an_unawaited_error_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    group = TaskGroup("svc", log=logging.getLogger("test.taskgroup"))

    async def boom() -> None:
        raise ValueError("kaput")

    task = group.spawn(boom(), name="boomer")
    with caplog.at_level(logging.ERROR, logger="test.taskgroup"):
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    [record] = [r for r in caplog.records if r.name == "test.taskgroup"]
    assert "svc: task boomer failed" in record.getMessage()
    assert isinstance(record.exc_info[1], ValueError)
    assert len(group) == 0
    await group.close()


async def test_an_awaited_error_is_left_to_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    group = TaskGroup(log=logging.getLogger("test.taskgroup"))

    async def boom() -> None:
        raise ValueError("kaput")

    with caplog.at_level(logging.ERROR, logger="test.taskgroup"):
        task = group.spawn(boom(), awaited=True)
        with pytest.raises(ValueError):
            await task
        await asyncio.sleep(0)
    assert not [r for r in caplog.records if r.name == "test.taskgroup"]
    assert len(group) == 0


async def test_adopted_task_is_cancelled_by_close_and_leaves_when_done() -> None:
    group = TaskGroup()
    inside = asyncio.Event()

    async def handler() -> None:
        with group.adopt():
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(handler())
    await inside.wait()
    assert list(group) == [task]
    await group.close()
    assert task.cancelled()

    async def quick() -> None:
        with TaskGroup().adopt():
            pass

    await quick()  # (an open group: adopt and release without a trace)


async def test_adopting_into_a_closed_group_cancels_the_task() -> None:
    group = TaskGroup()
    await group.close()

    async def late() -> None:
        with group.adopt():
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(late())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(group) == 0


async def test_close_from_inside_an_adopted_task_does_not_wait_for_itself() -> None:
    group = TaskGroup()
    other = group.spawn(asyncio.Event().wait())

    async def owner() -> None:
        with group.adopt():
            await group.close()

    await asyncio.wait_for(owner(), 5)
    assert other.cancelled()


async def test_close_does_not_cancel_twice_what_cancel_already_cancelled() -> None:
    """A task's cleanup (its ``finally``) may await: a second cancel would cut it short."""
    group = TaskGroup()
    started, in_cleanup, gate, cleaned = asyncio.Event(), asyncio.Event(), asyncio.Event(), []

    async def job() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            in_cleanup.set()
            await gate.wait()
            cleaned.append(True)

    group.spawn(job())
    await started.wait()
    group.cancel()  # (a connection's synchronous close)
    await in_cleanup.wait()
    closing = asyncio.ensure_future(group.close())
    await asyncio.sleep(0)  # close() runs up to its wait
    assert not closing.done()
    gate.set()
    await closing
    assert cleaned == [True]
