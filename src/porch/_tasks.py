"""Stopping a background task for certain."""

from __future__ import annotations

import asyncio

__all__ = ["cancel_and_wait"]

# How long one cancellation is given before it is sent again.
_RECANCEL = 0.1


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` (of the running loop) and return once it has ended.

    On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives as
    its inner await finishes (gh-86296), so a task cancelled inside one goes on
    running. The cancellation is sent again until the task has ended, so a
    close() never waits forever on a listener that missed it.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=_RECANCEL)
    if not task.cancelled():
        task.exception()  # retrieved: ending with one is the task's own business here
