"""cancel_and_wait: a background task is stopped for certain, even one that missed a cancel."""

from __future__ import annotations

import asyncio

import pytest

from porch._tasks import cancel_and_wait

pytestmark = pytest.mark.anyio


async def test_a_task_that_swallows_one_cancel_is_still_stopped() -> None:
    # What Python 3.11's wait_for does when the cancel meets its inner await finishing
    # (gh-86296): the cancel is lost and the task goes on to its next await.
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(60)

    loop = asyncio.get_running_loop()
    task = loop.create_task(stubborn())
    await asyncio.sleep(0)
    started = loop.time()
    # Bounded, and timed: on 3.11 wait_for's own timeout can end without raising.
    await asyncio.wait_for(cancel_and_wait(task), 10)
    assert loop.time() - started < 5
    assert swallowed.is_set()
    assert task.cancelled()


async def test_a_task_that_ended_with_an_error_is_retrieved_quietly() -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = asyncio.get_running_loop().create_task(broken())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.done()
    assert isinstance(task.exception(), RuntimeError)
