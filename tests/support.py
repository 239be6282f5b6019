"""Shared test helpers: waiting for a condition with a deadline, and fakes used by several files.

Tests wait for what they need to have happened (a batch reached the store, a
caller is parked) instead of sleeping a fixed time: a fixed sleep is too short
on a loaded machine and makes a passing test say nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["NoClaims", "settle", "until", "wait_until"]

# Long enough for a loaded 2-core machine; a condition that holds is seen at once anyway.
DEADLINE = 10.0


async def until(condition: Callable[[], object], what: str = "", within: float = DEADLINE) -> None:
    """Wait on the running loop until ``condition()`` is true; fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {within} s: {what or condition}")
        await asyncio.sleep(0.005)


def wait_until(condition: Callable[[], object], what: str = "", within: float = DEADLINE) -> None:
    """``until`` for threads and plain (sync) tests."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what or condition}")
        time.sleep(0.01)


async def settle(turns: int = 50) -> None:
    """Let the loop run ``turns`` rounds of whatever is ready.

    For asserting that something did *not* happen among in-memory actors (fake
    stores, gates): a wrongly ordered reply would be a few loop rounds away,
    whatever the machine's load, which a wall-clock sleep does not promise.
    """
    for _ in range(turns):
        await asyncio.sleep(0)


class NoClaims:
    """A fake store's claims: never held elsewhere, so never watched."""

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        raise AssertionError("nothing is ever held elsewhere in this fake store")
