"""Shared test helpers: waiting for a condition with a deadline, and fakes used by several files.

Tests wait for what they need to have happened (a batch reached the store, a
caller is parked) instead of sleeping a fixed time: a fixed sleep is too short
on a loaded machine and makes a passing test say nothing.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from porch.pool._shard import Call, Shard
from porch.store.base import Capabilities, Claims, Hit, StoreOp, StoreStatistics
from porch.store.sqlite import SQLiteStore

__all__ = [
    "HOSTILE_BODIES",
    "GatedBatch",
    "GatedStore",
    "HitCall",
    "NoClaims",
    "in_thread",
    "spin",
    "sqlite_claims",
    "stop_process",
    "through_apply",
    "until",
    "used",
    "wait_until",
]

T = TypeVar("T")


def used(hit: Any) -> list[int]:
    """What each fixed window of a decided ``hit`` has counted: its amount less what
    remains (exact while a window holds no more than its amount)."""
    return [a - r for a, r in zip(hit.amounts, hit.remaining, strict=True)]


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


def in_thread(call: Callable[[], T], within: float) -> T:
    """``call()`` in a daemon thread; fail (instead of hanging the suite) if it does not return.

    For what may hang the calling thread itself: an event loop's end (a runner
    waiting on a task that missed its cancel), a TestClient request.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    if thread.is_alive():
        pytest.fail(f"hung for {within} s")
    if error:
        raise error[0]
    return result[0]


async def spin(turns: int = 50) -> None:
    """Let the loop run ``turns`` rounds of whatever is ready.

    For asserting that something did *not* happen among in-memory actors (fake
    stores, gates): a wrongly ordered reply would be a few loop rounds away,
    whatever the machine's load, which a wall-clock sleep does not promise.
    """
    for _ in range(turns):
        await asyncio.sleep(0)


def sqlite_claims(path: Path) -> int:
    """Idempotency claims held now, by any process, on the SQLite store file ``path``.

    A claim is an OFD lock on ``<path>.locks``, which the kernel lists in /proc/locks
    (a line "N: -> OFDLCK ..." is a watcher blocked on one, not a claim).
    """
    locks = path.with_name(path.name + ".locks")
    if not locks.exists():
        return 0
    inode = str(locks.stat().st_ino)
    fields = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
    return sum(1 for f in fields if f[1] == "OFDLCK" and f[5].rsplit(":", 1)[1] == inode)


class NoClaims:
    """A fake store's claims: never held elsewhere, so never watched."""

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        raise AssertionError("nothing is ever held elsewhere in this fake store")


class GatedBatch:
    """A batch a :class:`GatedStore` was sent: it waits for its ``gate``, then raises
    its ``fail`` (or the store's), if any; ``applied`` once it passed."""

    def __init__(self, ops: Sequence[StoreOp]) -> None:
        self.ops = ops
        self.gate = asyncio.Event()
        self.fail: Exception | None = None
        self.applied = False


class GatedStore:
    """A fake store whose batches each wait for a gate, so a test holds a shard busy
    (:meth:`open_gates`: every batch passes, now and later) or decides the order batches
    finish in (``batches[i].gate``). Every hit it applies is allowed."""

    claims: Claims = NoClaims()
    secret = b"s" * 32

    def __init__(self, in_flight: int = 1) -> None:
        self.capabilities = Capabilities(in_flight=in_flight)
        self.batches: list[GatedBatch] = []
        self.fail: Exception | None = None  # every batch's, once past its gate
        self.closed = False
        self._open = False

    def open_gates(self) -> None:
        self._open = True
        for batch in self.batches:
            batch.gate.set()

    def sizes(self) -> list[int]:
        """How many ops each batch held, in arrival order."""
        return [len(batch.ops) for batch in self.batches]

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        batch = GatedBatch(ops)
        self.batches.append(batch)
        if self._open:
            batch.gate.set()
        await batch.gate.wait()
        batch.applied = True
        fail = batch.fail or self.fail
        if fail is not None:
            raise fail
        for op in ops:
            assert isinstance(op, Hit)
            op.allowed = True

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self.batches), sum(self.sizes()), 0)


def stop_process(process: subprocess.Popen[bytes], within: float = 20.0) -> None:
    """SIGTERM ``process`` if it still runs (a server shuts down cleanly), SIGKILL it if it
    has not ended ``within`` seconds later."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(within)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# Every one of these answered 500 or was accepted before the demo validated its input.
HOSTILE_BODIES: list[tuple[bytes, int]] = [
    (b"{", 400),
    (b"[1]", 400),
    (b"\xff", 400),
    (b"[" * 300_000 + b"]" * 300_000, 413),  # over the body cap before it is parsed
    (b"[" * 30_000 + b"]" * 30_000, 400),  # RecursionError in json
    (b'{"item": "x", "qty": ' + b"9" * 5000 + b"}", 400),  # past int()'s digit limit
    (b'{"item": "", "qty": 1}', 422),
    (b'{"item": "x", "qty": 0}', 422),
    (b'{"item": "x", "qty": true}', 422),
    (b'{"item": "x", "qty": 1.5}', 422),
    (b'{"item": "x", "qty": "1"}', 422),
    (b'{"item": 3, "qty": 1}', 422),
    (b'{"item": ["x"], "qty": 1}', 422),
    (b'{"item": "x", "qty": 99999999999999999999999}', 422),  # OverflowError in SQLite
    (b'{"item": "x", "qty": 9223372036854775808}', 422),
    (b'{"item": "\\ud800", "qty": 1}', 422),  # a lone surrogate: UnicodeEncodeError
    (b'{"item": "x\\udfffy", "qty": 1}', 422),
    (b'{"item": "' + b"x" * (64 * 1024 + 1) + b'", "qty": 1}', 422),
]


def through_apply(store: SQLiteStore, **changes: Any) -> None:
    """Make the pool reach ``store`` only through its ``apply``, for a test subclass that
    overrides it to hold batches back: without SQLite's inline and callback commits
    (Capabilities.apply_now, apply_then), which would pass the override by."""
    store.capabilities = replace(store.capabilities, apply_then=None, apply_now=None, **changes)


class HitCall(Call):
    """A hit sent straight to a pool's shard (``pool.submit(key, HitCall(hit))``): its future
    gets the hit once committed; ``finished``, if given, records the answer order."""

    __slots__ = ("finished", "hit")

    def __init__(self, hit: Hit, finished: list[HitCall] | None = None) -> None:
        super().__init__(asyncio.get_running_loop().create_future())
        self.hit = hit
        self.finished = finished

    def prepare(self, shard: Shard, ops: list[StoreOp]) -> None:
        ops.append(self.hit)

    def finish(self, shard: Shard) -> None:
        if self.finished is not None:
            self.finished.append(self)
        self.future.set_result(self.hit)


def asgi_client(app: Any, peer: str = "10.1.1.1", **headers: str) -> httpx.AsyncClient:
    """An httpx client calling ``app`` in process, as a connection from ``peer``."""
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers)


def sqlite_counters(directory: Path, *, nonzero: bool = False) -> dict[str, int]:
    """The counts of the SQLite store in ``directory``, by counter key, read from its rows
    by a connection of our own (``nonzero``: only the counts above 0; none before the
    store was first opened)."""
    path = directory / "porch.sqlite3"
    if nonzero and not path.exists():
        return {}
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT key, count FROM counters").fetchall()
    return {key: n for key, n in rows if n or not nonzero}
