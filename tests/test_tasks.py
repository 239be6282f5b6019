"""porch._tasks: a background task is stopped for certain, even one that missed a cancel."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from porch._tasks import cancel_and_wait, stop_if_cancelled, stop_task
from support import until

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


async def test_a_loop_that_lost_its_cancel_ends_at_its_next_turn() -> None:
    # A background loop asks stop_if_cancelled() at each turn: a cancel that an await
    # swallowed (as above) still ends it, without a second cancel.
    turns: list[int] = []

    async def background() -> None:
        while True:
            stop_if_cancelled()
            turns.append(1)
            with contextlib.suppress(asyncio.CancelledError):  # lost, as in wait_for
                await asyncio.sleep(60)

    task = asyncio.get_running_loop().create_task(background())
    await until(lambda: turns, "the first turn")
    task.cancel()  # once, as an event loop's end does
    await asyncio.wait({task}, timeout=10)
    assert task.cancelled()
    assert len(turns) == 1


async def test_a_task_that_never_stops_is_given_up_after_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    loop = asyncio.get_running_loop()
    task = loop.create_task(deaf())
    await asyncio.sleep(0)
    assert not await cancel_and_wait(task, deadline=0.3)
    assert not task.done()
    assert "did not stop within 0.3s" in caplog.text
    release.set()
    await asyncio.wait({task}, timeout=10)
    assert task.done()


async def test_a_task_of_another_loop_is_cancelled_but_never_awaited() -> None:
    other = asyncio.new_event_loop()
    try:
        task = other.create_task(asyncio.sleep(60))  # its loop is not running
        await stop_task(task)
        assert not task.done()  # nothing of that loop ran
        # Once that loop runs again (in a thread of its own), the cancel takes effect.
        await asyncio.to_thread(other.run_until_complete, asyncio.wait({task}, timeout=10))
        assert task.cancelled()
    finally:
        other.close()
