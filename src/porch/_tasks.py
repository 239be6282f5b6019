"""Background tasks that stop for certain, and awaits that end in time.

Python 3.11's ``asyncio.wait_for`` swallows a cancellation that arrives as its
inner await finishes (gh-86296): the task goes on as if it had never been
cancelled. An event loop's end (``asyncio.run``, anyio, each request of
Starlette's ``TestClient`` without ``with``) cancels every task once and then
waits for all of them, so one task that missed its cancel and goes on to wait
for something that never comes (the LISTEN connection's end) hangs that loop's
end forever. Hence, in porch:

- no ``asyncio.wait_for``: a deadline is ``asyncio.timeout``, whose own
  cancellation is told apart from one that comes from outside, which always
  goes through;
- every loop of a background task asks :func:`stop_if_cancelled` at each turn,
  so a cancel that a driver swallowed still ends the task at its next turn;
- a task is stopped with :func:`stop_task`, which never waits on a task of
  another loop nor longer than a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

__all__ = ["cancel_and_wait", "stop_if_cancelled", "stop_task"]

logger = logging.getLogger("porch")

# How long one cancellation is given before it is sent again.
_RECANCEL = 0.1
# How long a cancelled task is waited for before it is given up (with a warning).
STOP_TIMEOUT = 5.0


def stop_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to stop, even if an await lost it.

    A cancel that some await swallowed leaves its mark: ``Task.cancelling()``
    stays above zero (``asyncio.timeout`` takes back only its own).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(task: asyncio.Task[None], deadline: float = STOP_TIMEOUT) -> bool:
    """Cancel ``task`` (of the running loop); True once it has ended.

    The cancellation is sent again until the task has ended (one may be lost,
    see the module doc), for ``deadline`` seconds at most: a task that still
    runs then is given up with a warning and False, never waited on forever.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline
    while not task.done():
        if loop.time() >= give_up:
            logger.warning("porch: task %s did not stop within %gs; left behind", task, deadline)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=_RECANCEL)
    if not task.cancelled():
        task.exception()  # retrieved: ending with one is the task's own business here
    return True


async def stop_task(task: asyncio.Task[None] | None, deadline: float = STOP_TIMEOUT) -> None:
    """Stop ``task``: on the running loop, cancel it and wait (bounded, see cancel_and_wait).

    A task of another loop (one that stopped: the store moved with its pool)
    is only cancelled, never awaited: its loop may never run again.
    """
    if task is None:
        return
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved, as in cancel_and_wait
        return
    if task.get_loop() is asyncio.get_running_loop():
        await cancel_and_wait(task, deadline)
    else:
        with contextlib.suppress(RuntimeError):  # its loop is closed
            task.cancel()
