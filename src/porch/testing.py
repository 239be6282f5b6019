"""porch's pytest plugin: a throwaway store and pool, a clock a test moves, and helpers.

Installed with porch and loaded by pytest on its own (the ``pytest11`` entry point
``porch``); nothing to import. The fixtures:

- ``porch_clock``: a :class:`~porch.ManualClock`; ``porch_clock.advance(60)`` lets a minute
  pass for the store's windows and the limiters' refusal memory.
- ``porch_store``: a throwaway store that decides on ``porch_clock``: SQLite in a new
  temporary directory (removed afterwards), or, with ``--porch-store URL`` (or the
  ``PORCH_TEST_STORE`` environment variable), a PostgreSQL or Redis server, each test in a
  schema or key prefix of its own (dropped afterwards). Every store porch ships takes the
  test clock (``clock=``, a test hook): its rate-limit windows move with ``porch.advance``
  on PostgreSQL and Redis too. (Their idempotency claims, leases and stored responses keep
  the server's clock.) A third party's store that keeps its server's clock is still given
  (``porch.honours_clock`` says so) and ``porch.advance`` refuses it.
- ``porch_pool``: a :class:`~porch.KeyPool` over ``porch_store``, for your app's
  middlewares; it follows the event loop that uses it and is closed afterwards.
- ``porch``: a :class:`Porch` helper over the three — ``advance``, ``reset``, ``counts``,
  and ``assert_limited`` / ``assert_not_limited`` for responses.

For example, with an app factory that takes the pool::

    def test_the_sixth_request_is_refused(porch, porch_pool):
        client = TestClient(create_app(porch_pool))
        for _ in range(5):
            porch.assert_not_limited(client.get("/"))
        porch.assert_limited(client.get("/"))
        porch.advance(60)                      # the window has passed
        porch.assert_not_limited(client.get("/"))
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from .clock import ManualClock
from .errors import ConfigurationError
from .pool._pool import KeyPool
from .store.admin import StoreAdmin
from .store.base import Store
from .store.sqlite import SQLiteStore

__all__ = ["Porch", "assert_limited", "assert_not_limited"]

T = TypeVar("T")

# The limiters' default refusal memory: a refusal is answered from memory this long.
_REFUSAL_MEMORY = 1.0
_ENV = "PORCH_TEST_STORE"
# Each of the helpers' calls to the store (on a thread of its own) ends within this.
_HELPER_TIMEOUT = 60.0
# The Redis schemes: each test gets a key prefix of its own.
_REDIS = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("porch")
    group.addoption(
        "--porch-store",
        default=None,
        metavar="URL",
        help="the server porch_store uses (postgresql://..., redis://...), each test in a"
        f" schema or key prefix of its own; default: a temporary SQLite store (env {_ENV})",
    )


def assert_limited(response: Any) -> None:
    """Assert that ``response`` is porch's refusal: 429 with ``Retry-After`` (whole seconds,
    at least 1). ``response`` is any client's (httpx, requests, Starlette's, Flask's)."""
    # AssertionError raised, not assert: it must hold under python -O too.
    status = _status(response)
    if status != 429:
        raise AssertionError(f"expected porch's 429, got {status}")
    retry = _header(response, "retry-after")
    if retry is None or not retry.isdigit() or int(retry) < 1:
        raise AssertionError(f"a 429 without a valid Retry-After: {retry!r}")


def assert_not_limited(response: Any) -> None:
    """Assert that ``response`` was not refused by a rate limit (its status is not 429)."""
    status = _status(response)
    if status == 429:  # raised, not asserted: it holds under python -O too
        raise AssertionError(
            f"refused by a rate limit (Retry-After: {_header(response, 'retry-after')})"
        )


class Porch:
    """The ``porch`` fixture: the test's clock, store and pool, and what a test does to them.

    Every method may be called from a sync or an async test (the store's admin work runs
    on a thread of its own, on its own event loop).
    """

    def __init__(self, clock: ManualClock, store: Store, pool: KeyPool) -> None:
        self.clock = clock
        self.store = store
        self.pool = pool

    @property
    def honours_clock(self) -> bool:
        """Whether the store decides on ``clock`` (True for every store porch ships: the
        fixture gives each the test's clock; a store that keeps its server's clock: False)."""
        return self.store.capabilities.clock is self.clock

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the store's windows and the limiters' refusal memory."""
        if not self.honours_clock:
            raise ConfigurationError(
                f"{type(self.store).__name__} decides on its server's clock: porch.advance()"
                " cannot move it (use the SQLite store for tests that move time)"
            )
        self.clock.advance(seconds)

    def reset(self, client: str | None = None, *, rule: str | None = None) -> int:
        """Delete the counters of ``client`` (of one ``rule``), or of every client; returns how
        many. A client refused from a limiter's memory is asked again only after it (1 s):
        with the test's clock, that second is let pass too."""
        deleted = self._admin(lambda admin: _reset(admin, client, rule))
        if self.honours_clock:
            self.clock.advance(_REFUSAL_MEMORY)
        return deleted

    def counts(self, client: str) -> dict[str, int]:
        """The live counts of ``client``: ``{"rule/limit": count}``."""
        found = self._admin(lambda admin: admin.counters(client=client))
        return {f"{c.rule}/{c.limit}": c.count for c in found}

    assert_limited = staticmethod(assert_limited)
    assert_not_limited = staticmethod(assert_not_limited)

    def _admin(self, work: Callable[[StoreAdmin], Awaitable[T]]) -> T:
        make = self.store.capabilities.admin
        if make is None:
            raise ConfigurationError(f"{type(self.store).__name__} has no admin protocol")

        async def run() -> T:
            admin = make()
            try:
                return await work(admin)
            finally:
                await admin.close()

        return _on_a_thread(run)


async def _reset(admin: StoreAdmin, client: str | None, rule: str | None) -> int:
    if client is not None:
        return await admin.reset(client=client, rule=rule)
    clients = {c.client for c in await admin.counters(most=1_000_000)}
    return sum([await admin.reset(client=c, rule=rule) for c in sorted(clients)])


def _on_a_thread(run: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(run())`` on a thread of its own: callable with or without a running loop."""
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(_awaiting(run)))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    # A daemon: one that never finishes (a server that stopped answering) is given up
    # below and must not hold the test run's exit either.
    thread = threading.Thread(target=target, name="porch-testing", daemon=True)
    thread.start()
    thread.join(_HELPER_TIMEOUT)
    if thread.is_alive():
        raise TimeoutError(f"porch's test helper did not finish within {_HELPER_TIMEOUT:g} s")
    if failure:
        raise failure[0]
    return result[0]


async def _awaiting(run: Callable[[], Awaitable[T]]) -> T:
    return await run()


def _status(response: Any) -> int:
    for name in ("status_code", "status"):
        value = getattr(response, name, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"not a response with a status code: {response!r}")


def _header(response: Any, name: str) -> str | None:
    headers = getattr(response, "headers", {})
    value = headers.get(name)
    return None if value is None else str(value)


@pytest.fixture
def porch_clock() -> ManualClock:
    """A clock the test moves (``advance``); the store and the limiters read it."""
    return ManualClock()


@pytest.fixture
def porch_store(request: pytest.FixtureRequest, porch_clock: ManualClock) -> Iterator[Store]:
    """A throwaway store deciding on ``porch_clock`` (see the module's doc)."""
    url = request.config.getoption("--porch-store") or os.environ.get(_ENV)
    if not url:
        store: Store = SQLiteStore.temporary(clock=porch_clock)
        _on_a_thread(lambda: _created(store))
        yield store
        return
    from .store import open_store

    scheme = url.split(":", 1)[0].lower()
    name = f"porch_t{uuid.uuid4().hex[:12]}"
    # The network stores decide their counters on the test's clock (their test hook).
    if scheme.startswith("postgres"):
        store = open_store(url, schema=name, clock=porch_clock)
    elif scheme in _REDIS:
        store = open_store(url, prefix=name, clock=porch_clock)
    else:
        store = open_store(url, clock=porch_clock)
    try:
        _on_a_thread(lambda: _created(store))
        yield store
    finally:
        _on_a_thread(lambda: _drop(url, scheme, name))


async def _created(store: Store) -> None:
    """Open and close ``store`` once, so its tables exist before a test reads them."""
    await store.open()
    await store.close()


async def _drop(url: str, scheme: str, name: str) -> None:
    """Remove what one test's network store left: its schema, or its keys."""
    if scheme.startswith("postgres"):
        import asyncpg

        conn = await asyncpg.connect(url, timeout=10, command_timeout=30)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        finally:
            await conn.close(timeout=10)
    elif scheme in _REDIS:
        import redis.asyncio

        client: Any
        if scheme.endswith("+cluster"):
            from .store.redis.cluster import cluster_client

            client = cluster_client(url)
        else:
            client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=30)
        try:
            async for key in client.scan_iter(match=f"{name}:*", count=1000):
                await client.delete(key)
        finally:
            await client.aclose()


@pytest.fixture
def porch_pool(porch_store: Store) -> Iterator[KeyPool]:
    """A key pool over ``porch_store``, closed after the test (on whichever loop it ran)."""
    pool = KeyPool(porch_store)
    yield pool
    _on_a_thread(pool.close)


@pytest.fixture
def porch(porch_clock: ManualClock, porch_store: Store, porch_pool: KeyPool) -> Porch:
    """The test's clock, store and pool with porch's helpers (:class:`Porch`)."""
    return Porch(porch_clock, porch_store, porch_pool)
