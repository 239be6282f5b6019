"""Waiting for a claim held on another host: one LISTEN connection per process, no polling.

Every :class:`~porch.store.base.Save` and :class:`~porch.store.base.Release`
sends ``NOTIFY <channel>, md5(key)`` in its own transaction, so the
notification leaves exactly when the claim came free. This process keeps one
connection listening on the channel and dispatches each notification to the
watchers of that key. Each watch also sets a timer at the holder's lease end:
the backstop for a holder that died (no notification ever comes) and for a
listener that is reconnecting. Once the listener (re)connects, every watched
key is woken once, since notifications sent while it was not listening are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..._tasks import stop_if_cancelled, stop_task

__all__ = ["ListenerClaims"]

logger = logging.getLogger("porch.store.postgres")

# A notification that arrives just before its key is watched (the claim that
# saw "held" and the holder's save crossed on the wire) is kept this long.
_RECENT = 1.0
# Past the lease end, so the server's clock has also passed it when we re-claim.
_MARGIN = 0.02


def key_hash(key: str) -> str:
    """The notification payload for ``key``, as PostgreSQL's md5(convert_to(key, 'UTF8'))."""
    return hashlib.md5(key.encode("utf-8", "surrogatepass"), usedforsecurity=False).hexdigest()


class _Watch:
    __slots__ = ("done", "key", "timer", "wake")

    def __init__(self, key: str, wake: Callable[[], None]) -> None:
        self.key = key
        self.wake = wake
        self.done = False
        self.timer: asyncio.TimerHandle | None = None


class ListenerClaims:
    """:class:`~porch.store.base.Claims` for the PostgreSQL store."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        channel: str,
        lease: float,
    ) -> None:
        self._connect = connect
        self.channel = channel
        self.lease = lease
        self._watchers: dict[str, set[_Watch]] = {}
        self._recent: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connected = asyncio.Event()
        self.reconnects = 0

    # -- the listening connection ----------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._listen(), name="porch-pg-listen")

    async def stop(self) -> None:
        task, self._task = self._task, None
        # Of a loop that stopped (the store moved to this one), it is only cancelled.
        await stop_task(task)
        self._drop_connection()
        for watches in list(self._watchers.values()):
            for w in watches:
                if w.timer is not None:
                    w.timer.cancel()
        self._watchers.clear()

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self.connected.clear()
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(RuntimeError):  # a connection of a closed loop
                conn.terminate()  # never waits on a server that does not answer

    async def _listen(self) -> None:
        delay = 0.1
        first = True
        while True:
            lost = asyncio.Event()
            conn: Any = None
            try:
                stop_if_cancelled()
                conn = await self._connect()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                async with asyncio.timeout(5.0):
                    await conn.add_listener(self.channel, self._notified)
                # Asked to stop while connecting (a cancel some await lost): never wait
                # on the connection then, or the loop's end waits on this task forever.
                stop_if_cancelled()
            except BaseException as exc:
                if conn is not None and not conn.is_closed():
                    conn.terminate()  # made, but not listening: never left open
                if not isinstance(exc, Exception):
                    raise
                logger.warning("porch: cannot LISTEN on PostgreSQL (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self._conn = conn
            self.connected.set()
            delay = 0.1
            if not first:
                self.reconnects += 1
                logger.info("porch: LISTEN connection to PostgreSQL is back")
            first = False
            # Whatever was notified while we were not listening is lost: everyone looks
            # again. The first connect too: open() does not wait for it, so a key may
            # have been watched (and freed) before this LISTEN began.
            self._wake_all()
            try:
                await lost.wait()
            finally:  # cancelled too (stop(), or the loop shutting down): closed on this loop
                self._drop_connection()
            logger.warning("porch: LISTEN connection to PostgreSQL lost; reconnecting")

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        watches = self._watchers.pop(payload, None)
        if watches is None:
            self._remember(payload)
            return
        for w in watches:
            self._fire(payload, w)

    def _remember(self, payload: str) -> None:
        if self._loop is None:
            return
        now = self._loop.time()
        recent = self._recent
        recent.pop(payload, None)
        recent[payload] = now  # insertion order is arrival order
        for old, at in list(recent.items()):
            if now - at <= _RECENT:
                break
            del recent[old]

    def _wake_all(self) -> None:
        watchers, self._watchers = self._watchers, {}
        for h, watches in watchers.items():
            for w in watches:
                self._fire(h, w)

    # -- watching ----------------------------------------------------------------------

    def _fire(self, h: str, w: _Watch) -> None:
        if w.done:
            return
        w.done = True
        if w.timer is not None:
            w.timer.cancel()
        watches = self._watchers.get(h)
        if watches is not None:
            watches.discard(w)
            if not watches:
                del self._watchers[h]
        try:
            w.wake()
        except Exception:  # one broken waiter must not stop the others
            logger.exception("porch: an idempotency waiter's wake-up failed")

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        h = key_hash(key)
        w = _Watch(key, wake)
        at = self._recent.pop(h, None)
        if at is not None and loop.time() - at <= _RECENT:
            # Freed while our claim's answer was on its way: look again now.
            loop.call_soon(self._fire, h, w)
        else:
            self._watchers.setdefault(h, set()).add(w)
            delay = self.lease if retry_after is None else max(0.0, retry_after)
            w.timer = loop.call_later(delay + _MARGIN, self._fire, h, w)

        def cancel() -> None:
            if not w.done:
                w.done = True
                if w.timer is not None:
                    w.timer.cancel()
                watches = self._watchers.get(h)
                if watches is not None:
                    watches.discard(w)
                    if not watches:
                        del self._watchers[h]

        return cancel

    def watched(self) -> int:
        """How many watches are waiting (for tests and statistics)."""
        return sum(len(v) for v in self._watchers.values())
