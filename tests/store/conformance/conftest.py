"""One fresh, isolated store per test, for every backend the conformance suite runs on.

``backend`` is parametrised over ``sqlite`` / ``postgres`` / ``redis`` /
``redis-cluster`` (each with its marker, so ``-m redis`` runs one engine: the
cluster is Redis's). SQLite gets a temp dir and a :class:`ManualClock`;
PostgreSQL a schema of its own on the session server; Redis and the Redis
Cluster (3 primaries, 3 replicas) a key prefix of their own. A backend whose
store module is missing, or whose server cannot be started, skips or fails as
``tests/servers.py`` decides (it fails when PORCH_REQUIRE_BACKENDS names it).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from porch.clock import ManualClock, SystemClock
from porch.pool._pool import KeyPool
from porch.store.base import Algorithm, Hit, Store
from porch.store.sharded import ShardedStore
from servers import missing_backend

from .model import Policy, Report

_MODULES = {
    "sqlite": ("porch.store.sqlite", "SQLiteStore"),
    "postgres": ("porch.store.postgres", "PostgresStore"),
    "redis": ("porch.store.redis", "RedisStore"),
    "redis-cluster": ("porch.store.redis", "RedisClusterStore"),
}
HOLDER = Path(__file__).with_name("holder.py")
# The network backends whose store takes a test clock for its counters: ``clock=`` (a
# ManualClock) makes it decide hits and settles at ``clock.monotonic()``, sent with each
# batch, instead of at its server's time. A test hook: the policies' conformance
# (test_policies.py) compares such a store with the reference model to the bit, and
# skips a backend not named here. SQLite's whole store runs on its injected clock.
COUNTER_CLOCKS: frozenset[str] = frozenset(
    {"postgres", "redis", "redis-cluster", "sharded-postgres", "sharded-redis"}
)
# The sharded backends: a ShardedStore over two servers of one kind (the kind's store
# class, each child with the test's isolation and options).
SHARDED = {"sharded-postgres": "postgres", "sharded-redis": "redis"}


def one_home(store: Store, runs: Iterator[int], keys: Callable[[int], list[str]]) -> int:
    """The next of ``runs`` whose ``keys(run)`` (counter keys) are all on one home of a
    sharded store (the next, on any other store): a run whose hits a store decides in one
    step, as the reference model does (across homes: tests/store/sharded)."""
    while True:
        run = next(runs)
        if not isinstance(store, ShardedStore) or len({store.home(k) for k in keys(run)}) == 1:
            return run


def hit_on(policies: list[Policy], cost: int) -> Hit:
    """A hit on every one of ``policies`` (a rule's limits), taking ``cost`` units."""
    algorithms: list[Algorithm] = [p.algorithm for p in policies]  # type: ignore[misc]
    return Hit(
        [p.key for p in policies],
        [p.amount for p in policies],
        [p.window for p in policies],
        algorithms,
        [p.burst for p in policies],
        cost,
    )


def report_of(hit: Hit) -> Report:
    """What a store answered ``hit``, as the model answers it."""
    return Report(
        hit.allowed,
        list(hit.fits),
        list(hit.remaining),
        list(hit.next),
        list(hit.full),
        list(hit.retry),
        list(hit.stamp),
    )


class Backend:
    """Opens stores on one isolated piece of backing data, and closes them at teardown."""

    def __init__(
        self,
        name: str,
        factory: Any,
        target: Any,
        isolation: dict[str, Any],
        url: str,
        clock: ManualClock | None,
    ) -> None:
        self.name = name
        self._factory = factory
        self._target = target  # the directory (SQLite) or the server URL
        self.isolation = isolation  # schema / prefix options: the same data for every store
        self.url = url  # for porch.open_store in a subprocess
        self.clock = clock
        self.leases = name != "sqlite"
        self.stores: list[Store] = []
        self.holders: list[Holder] = []
        self.pools: list[KeyPool] = []

    def on(self, server_url: str) -> Backend:
        """The same backend and isolation on another server (a failure leg's own)."""
        return Backend(self.name, self._factory, server_url, self.isolation, server_url, None)

    def counter_clock(self) -> ManualClock | None:
        """A manual clock this backend's counters can be decided on (see COUNTER_CLOCKS):
        the backend's own (SQLite), a new one at the current time for a network store
        that takes one, or None."""
        if self.clock is not None:
            return self.clock
        if self.name in COUNTER_CLOCKS:
            now = time.time()
            return ManualClock(monotonic=now, wall=now)
        return None

    def together(self, store: Store, *keys: str, counter: bool = True) -> list[str]:
        """``keys`` as they are on one store; on a sharded store, each with one suffix that
        puts them all on one home (counter keys, or with ``counter=False`` response keys):
        what a test of decisions taken in one store step asks for (across homes a hit is
        decided in steps: tests/store/sharded)."""
        if not isinstance(store, ShardedStore):
            return list(keys)
        for n in range(10_000):
            named = [f"{key}~{n}" for key in keys]
            if len({store.home(key, counter=counter) for key in named}) == 1:
                return named
        raise AssertionError("no suffix puts the keys on one home")

    def quotas_across_keys(self) -> None:
        """Skip on a sharded store: a test whose quota counts responses of keys that live on
        several homes (bare keys, each its own home). A sharded store counts a caller
        scope's bytes on its one home, exactly, and a client's and the total per home
        (docs/stores/sharding.md; tests/store/sharded/test_sharded.py)."""
        if self.name in SHARDED:
            pytest.skip("quotas over keys on several homes count per home (sharding.md)")

    def lease(self, seconds: float) -> dict[str, Any]:
        """The option giving a store's claims a lease of ``seconds`` (none for SQLite)."""
        return {"lease": seconds} if self.leases else {}

    def unopened(self, **options: Any) -> Store:
        """A store on this test's data that is not opened (nor closed at teardown)."""
        store: Store = self._factory(self._target, **self.isolation, **options)
        return store

    async def store(self, **options: Any) -> Store:
        """A newly opened store on this test's data: another 'process' or 'host'."""
        store = self.to_open(**options)
        await store.open()
        # PostgreSQL's open() does not wait for its LISTEN connection, which wakes every
        # watch once it connects (tests/store/postgres/test_listener.py): have it, so a
        # test's watches see only the wakes it causes, and a server stop is a reconnect.
        children = store.stores if isinstance(store, ShardedStore) else [store]
        for child in children:
            listening = getattr(child.claims, "connected", None)
            if listening is not None:
                await asyncio.wait_for(listening.wait(), 20)
        return store

    def to_open(self, **options: Any) -> Store:
        """A store on this test's data for the test to open (closed at teardown all the same)."""
        if self.clock is not None:
            options.setdefault("clock", self.clock)
        store: Store = self._factory(self._target, **self.isolation, **options)
        self.stores.append(store)
        return store

    async def close_store(self, store: Store) -> None:
        """Close one of this test's stores now (the way its process would end)."""
        self.stores.remove(store)
        await store.close()

    async def pool(self, *, size: int = 4, **options: Any) -> KeyPool:
        """A started key pool over a store of its own (closed, with its store, at teardown)."""
        if self.clock is not None:
            options.setdefault("clock", self.clock)
        pool = KeyPool(self._factory(self._target, **self.isolation, **options), size=size)
        await pool.start()
        self.pools.append(pool)
        return pool

    async def elapse(self, seconds: float) -> None:
        """Let time pass: the ManualClock for SQLite, real time on a server's clock."""
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)

    @property
    def tolerance(self) -> float:
        """How far a server-clock reading may be off an exact figure on a loaded machine."""
        return 1e-9 if self.clock is not None else 0.3

    async def holder(self, key: str, env: dict[str, str] | None = None, **options: Any) -> Holder:
        """A separate process that opens this data from a URL and claims ``key`` (``-``: none).

        ``env`` adds to its environment (e.g. libfaketime's, to skew its clock).
        """
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HOLDER),
            self.url,
            json.dumps({**self.isolation, **options}),
            key,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        holder = Holder(process)
        self.holders.append(holder)
        holder.claim = await holder.read()
        return holder

    async def close(self) -> None:
        """Kill the holders, close the pools and stores this test opened."""
        for holder in self.holders:
            await holder.kill()
        for pool in self.pools:
            await pool.close()
        for store in self.stores:
            await store.close()
        self.holders, self.pools, self.stores = [], [], []


class Holder:
    """The holder subprocess: it claimed a key; tell it to save or release; kill it."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.claim: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def token(self) -> int:
        return int(self.claim["token"])

    async def read(self, within: float = 20.0) -> dict[str, Any]:
        stdout = self.process.stdout
        if stdout is None:  # pragma: no cover - always piped
            raise RuntimeError("no stdout")
        line = await asyncio.wait_for(stdout.readline(), within)
        if not line:
            raise RuntimeError(f"the holder exited ({await self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def send(self, command: str) -> dict[str, Any]:
        stdin = self.process.stdin
        if stdin is None:  # pragma: no cover - always piped
            raise RuntimeError("no stdin")
        stdin.write(command.encode() + b"\n")
        await stdin.drain()
        return await self.read()

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def _drop_schema(url: str, schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def _drop_prefix(url: str, prefix: str) -> None:
    import redis.asyncio

    client: Any
    if url.startswith("redis+cluster://"):
        from porch.store.redis.cluster import cluster_client

        client = cluster_client(url)
    else:
        client = redis.asyncio.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-cluster", marks=pytest.mark.redis),
        pytest.param("sharded-postgres", marks=[pytest.mark.postgres, pytest.mark.sharded]),
        pytest.param("sharded-redis", marks=[pytest.mark.redis, pytest.mark.sharded]),
    ]
)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    name: str = request.param
    kind = SHARDED.get(name, name)
    module_name, class_name = _MODULES[kind]
    if importlib.util.find_spec(module_name) is None:
        missing_backend(kind, f"{module_name} does not exist")
    factory = getattr(importlib.import_module(module_name), class_name)
    servers: list[str] = []
    tag = uuid.uuid4().hex[:12]
    backend: Backend
    if name == "sqlite":
        # Starts at the real readings: a holder subprocess runs on the system clock, and
        # both must agree on the boot and roughly on the time (its stored responses' TTL).
        real = SystemClock()
        clock = ManualClock(monotonic=real.monotonic(), wall=real.wall(), boot_id=real.boot_id())
        url = f"sqlite:///{tmp_path}/porch.sqlite3"
        backend = Backend(name, factory, tmp_path, {}, url, clock)
    elif name == "postgres":
        server: str = request.getfixturevalue("postgres_url")
        backend = Backend(name, factory, server, {"schema": f"porch_t{tag}"}, server, None)
    elif name in ("redis", "redis-cluster"):
        fixture = "redis_cluster_url" if name == "redis-cluster" else "redis_url"
        server = request.getfixturevalue(fixture)
        backend = Backend(name, factory, server, {"prefix": f"porch-t{tag}:"}, server, None)
    else:
        servers = [
            request.getfixturevalue(f"{kind}_url"),
            request.getfixturevalue(f"second_{kind}_url"),
        ]
        isolation = {"schema": f"porch_t{tag}"} if kind == "postgres" else {"prefix": f"p-t{tag}:"}
        backend = Backend(
            name, _sharded(factory), tuple(servers), isolation, json.dumps(servers), None
        )
    try:
        yield backend
    finally:
        await backend.close()
        for url in servers or [backend.url]:
            if kind == "postgres":
                await _drop_schema(url, backend.isolation["schema"])
            elif kind in ("redis", "redis-cluster"):
                await _drop_prefix(url, backend.isolation["prefix"])


def _sharded(factory: Any) -> Any:
    """A factory of sharded stores over the servers it is given, each child of ``factory``."""

    def make(servers: tuple[str, ...], **options: Any) -> ShardedStore:
        return ShardedStore([factory(url, **options) for url in servers])

    return make
