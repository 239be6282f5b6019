"""The background event loop of one WSGI process: started at first use, stopped at exit.

Started lazily so that a forking server (gunicorn's sync workers) gives each
worker its own loop thread after the fork; stopped at exit after closing the
pool on it, so no task is left pending.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading

from ...errors import PoolClosedError
from ...pool._pool import KeyPool

__all__ = ["BackgroundLoop"]

logger = logging.getLogger("porch.integrations.wsgi")

# Stopping at exit is bounded: a wedged store must not hold the worker's exit forever.
_STOP_TIMEOUT = 10.0
# So is starting: a loop thread that gets no CPU for this long fails the request (503),
# not a worker thread blocked without end.
_START_TIMEOUT = 10.0


class BackgroundLoop:
    """The event loop ``pool`` runs on in this process, on a thread of its own."""

    __slots__ = ("_guard", "_loop", "_pid", "_pool", "_registered", "_thread")

    def __init__(self, pool: KeyPool) -> None:
        self._pool = pool
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._registered = False

    def get(self) -> asyncio.AbstractEventLoop:
        """The loop, started at the first call in this process; PoolClosedError if its
        thread did not start in time."""
        loop = self._loop
        if loop is not None and self._pid == os.getpid():
            return loop
        with self._guard:
            if self._loop is not None and self._pid == os.getpid():
                return self._loop
            # First use in this process (a forked worker never has its parent's thread).
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(
                target=_run, args=(loop, ready), name="porch-wsgi-loop", daemon=True
            )
            thread.start()
            if not ready.wait(_START_TIMEOUT):
                # It stops (and closes its loop) whenever it does start; the next request
                # starts another.
                loop.call_soon_threadsafe(loop.stop)
                raise PoolClosedError(
                    f"porch's event loop thread did not start within {_START_TIMEOUT:g} s"
                )
            self._loop, self._thread, self._pid = loop, thread, os.getpid()
            if not self._registered:
                atexit.register(self.stop)
                self._registered = True
            return loop

    def stop(self) -> None:
        """Close the pool on its loop, then stop the loop and its thread."""
        with self._guard:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None or self._pid != os.getpid():
                return
            self._loop = self._thread = None
        try:
            asyncio.run_coroutine_threadsafe(self._pool.close(), loop).result(_STOP_TIMEOUT)
        except Exception as exc:  # exiting anyway: say so, never a traceback at exit
            logger.error("porch: closing the pool at exit failed: %r", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_STOP_TIMEOUT)


def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
        # Whatever still runs (a request cut short at exit) ends here, not in a warning.
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
