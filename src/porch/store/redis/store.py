"""The Redis store: every op a server-side script, a shard's whole drain one pipeline.

Counters, claims and stored responses change only inside Lua scripts that
read the server's ``TIME``, so every app host decides on the same clock and
each decision is atomic on the server; nothing is read, decided in Python and
written back. Scripts run by SHA (``EVALSHA``), loaded at open and again
after a ``NOSCRIPT`` (a ``SCRIPT FLUSH``, a restart, a failover).

A claim is a lease in server time with a fence token. While the process
lives, a heartbeat renews every claim it holds every ``lease / 3`` seconds in
one pipeline, from a thread with a client of its own (see
:mod:`porch.store._leases`: a blocked event loop does not stop it); close()
releases them. A holder that dies (or freezes, or loses its network) stops
renewing, so its key is free ``lease`` seconds later at most, and its late
Save is refused (fenced) once another owner took the key. A claim's record outlives
its lease: a holder renewing late, with nobody taking the key meanwhile, still saves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Sequence
from secrets import token_bytes
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..._tasks import stop_task
from ...clock import Clock
from ...errors import ConfigurationError, StoreError
from .._leases import Heartbeat, HeldLeases, Renewer, confirm_late, let_lapse
from .._watches import Watches
from ..alike import collapse_hits
from ..base import ALGORITHMS, PART_GRACE, SECRET_BYTES, Capabilities, StoreOp, StoreStatistics
from ..transport import check_transport
from ..urls import redact
from . import wire
from .claims import Renewals, Subscription
from .commands import Command, command, fill_from_reply
from .group import GroupPipeline
from .keys import KeyNames
from .parts import RedisParts
from .scripts import Script, load_scripts

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from .admin import RedisAdmin

__all__ = ["RedisStore"]

logger = logging.getLogger("porch.store")

# Pipelines a process keeps in flight; batches queued meanwhile leave together next.
_PIPELINES_IN_FLIGHT = 2
# Closing a client never waits longer on a server that does not answer.
_CLOSE_TIMEOUT = 1.0


def _check_transport(url: str, client: Redis) -> None:
    """Say once if the server is another host reached without TLS and a certificate check:
    what the client's connections really do (redis-py's defaults included), not the URL."""
    import ssl

    from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection

    pool = client.connection_pool
    kind, options = pool.connection_class, pool.connection_kwargs
    peer = None if issubclass(kind, UnixDomainSocketConnection) else options.get("host")
    tls = issubclass(kind, SSLConnection)
    required = options.get("ssl_cert_reqs", "required")
    verified = (
        required == ssl.CERT_REQUIRED or str(required).lower() == "required"
    ) and options.get("ssl_check_hostname", True) not in (False, "false", "0", "no")
    check_transport(
        "Redis",
        url,
        peer,
        tls=tls,
        verified=verified,
        setting="rediss:// with ssl_ca_certs=<the server's CA> (certificate and host checked)",
    )


class RedisStore:
    """Counters, stored responses and idempotency claims in one Redis server.

    ``url``: ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``).
    ``prefix`` namespaces every key and the wake-up channel. ``lease``: seconds a
    claim outlives its holder's last heartbeat. ``connect_timeout`` and
    ``timeout`` bound each connection attempt and each reply, so a stopped or
    frozen server fails an apply with StoreError instead of hanging;
    ``max_connections`` caps the pool, and a caller finding every connection
    busy waits up to ``pool_timeout`` for one. ``in_flight``: batches one pool
    shard keeps out at once (see ``Capabilities.in_flight``). ``part_grace``: seconds after
    its last part a body streamed in parts that no record names (its owner died
    mid-stream) is deleted (see :class:`~porch.store.base.PartStore`).

    ``clock``: a test hook. Given one (a ``ManualClock``), hits and settles are decided
    at its ``monotonic()`` time, sent with each script call, instead of at the server's
    ``TIME`` (and ``Hit.wall`` is its ``wall()``), so a test can move time for the
    counters; claims, leases and stored responses keep the server's clock, and the
    counters' keys still expire on it (ten minutes late, so the test clock decides).
    Never in production: hosts would each decide on their own clock.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "porch",
        lease: float = 3.0,
        connect_timeout: float = 2.0,
        timeout: float = 5.0,
        max_connections: int = 32,
        pool_timeout: float = 5.0,
        reconnect_delay: float = 0.5,
        in_flight: int = 2,
        clock: Clock | None = None,
        part_grace: float = PART_GRACE,
    ) -> None:
        self._check_url(url)
        if not prefix or any(c in prefix for c in "{}"):
            raise ConfigurationError(f"prefix must be non-empty without braces, got {prefix!r}")
        if not lease > 0:
            raise ConfigurationError(f"lease must be > 0 seconds, got {lease}")
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("timeout", timeout),
            ("pool_timeout", pool_timeout),
            ("reconnect_delay", reconnect_delay),
            ("part_grace", part_grace),
        ):
            if not value > 0:
                raise ConfigurationError(f"{name} must be > 0 seconds, got {value}")
        if not 1 <= in_flight <= 16:
            raise ConfigurationError(f"in_flight must be 1-16, got {in_flight}")
        if max_connections < 2:
            raise ConfigurationError(f"max_connections must be >= 2, got {max_connections}")
        try:
            import redis.asyncio  # noqa: F401  (optional driver, checked at construction)
        except ImportError:
            raise ConfigurationError(
                "the Redis store needs the redis client: pip install 'porch[redis]'"
            ) from None
        self.url = url
        self.prefix = prefix
        self.lease = lease
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.max_connections = max_connections
        self.pool_timeout = pool_timeout
        self.clock = clock
        self.names = KeyNames(prefix, cluster=self._CLUSTER)
        # Bodies streamed in parts, on the store's client outside the batches' pipelines.
        self._parts = RedisParts(
            self.names, self._execute_now, self._delete, grace=float(part_grace)
        )
        self.capabilities = Capabilities(
            # Four shards, whose batches go out on connections side by side.
            shards=4,
            in_flight=in_flight,
            clock=clock,
            admin=self.admin,
            algorithms=frozenset(ALGORITHMS),
            parts=self._parts,
            # Leases renewed by the heartbeat (_slots.lua): a dead holder's within `lease`.
            slots=True,
            slot_lease=float(lease),
        )
        self._subscription = self._new_subscription()
        self.claims = Watches(
            self._subscription,
            _same,  # the scripts publish the logical key itself
            lease=lease,
            reconnect_delay=reconnect_delay,
            logger=logger,
        )
        self._scripts: dict[str, Script] = load_scripts()
        self._heads = wire.heads({name: s.sha for name, s in self._scripts.items()})
        self._lease_ms = max(1, math.ceil(lease * 1000))
        self._client: Redis | None = None
        self._closing: asyncio.Event | None = None
        self._keeper: asyncio.Task[None] | None = None  # closes the clients, on their loop
        self._heartbeat: Heartbeat | None = None
        self._group: GroupPipeline | None = None
        self._held = HeldLeases()  # the claims this process holds, renewed by the heartbeat
        self._transport_checked = False
        self._secret: bytes | None = None  # the prefix's, read when it is opened
        self._transactions = 0
        self._operations = 0
        self._failures = 0

    # A Redis Cluster store (a subclass) names its keys for the Cluster's slots.
    _CLUSTER = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r}, prefix={self.prefix!r})"

    def _check_url(self, url: str) -> None:
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigurationError(
                f"a Redis store URL starts with redis://, rediss:// or unix://, got {scheme!r}"
            )

    def _new_subscription(self) -> Subscription:
        return Subscription(self.names.channel)

    # -- lifecycle -----------------------------------------------------------------

    def _connect(self, max_connections: int) -> Redis:
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        pool = BlockingConnectionPool.from_url(
            self.url,
            max_connections=max_connections,
            timeout=self.pool_timeout,
            socket_connect_timeout=self.connect_timeout,
            socket_timeout=self.timeout,
            socket_keepalive=True,
            # Never resend: a script whose reply was lost may have run (a hit counted).
            retry=Retry(NoBackoff(), 0),
        )
        return Redis(connection_pool=pool)

    async def open(self) -> None:
        if self._client is not None:
            return
        client = self._connect(self.max_connections)
        subscriber = self._connect(1)
        wait = self.connect_timeout + self.timeout
        try:
            await self._load_scripts(client)
            self._secret = await self._read_secret(client)
            self._subscription.client = subscriber
            self.claims.start()
            try:
                async with asyncio.timeout(wait):
                    await self.claims.connected.wait()
            except TimeoutError:
                raise StoreError(f"no wake-up subscription within {wait:g}s") from None
        except BaseException as exc:
            await self.claims.stop()
            await _close_client(subscriber)
            await _close_client(client)
            if isinstance(exc, Exception):
                raise StoreError(redact(f"cannot open Redis store {self.url}: {exc}")) from exc
            raise
        if not self._transport_checked:
            self._transport_checked = True
            self._check_transport(client)
        self._client = client
        self._closing = asyncio.Event()
        self._keeper = asyncio.get_running_loop().create_task(
            _keep(self._closing, client, subscriber), name="porch-redis-clients"
        )
        self._group = GroupPipeline(
            functools.partial(self._send, client), limit=_PIPELINES_IN_FLIGHT
        )
        # Leases of their own: a heartbeat left finishing by an earlier close() that was cut
        # short releases only the claims of its time.
        self._held = HeldLeases()
        self._heartbeat = Heartbeat(
            self._held,
            lease=self.lease,
            renewer=self._renewals,
            deadline=self.connect_timeout + self.timeout + 1.0,
            name="porch-redis-heartbeat",
            logger=logger,
        )
        self._heartbeat.start()

    def _check_transport(self, client: Redis) -> None:
        _check_transport(self.url, client)

    def _renewals(self) -> Renewer:
        """The heartbeat's renewer, with a client of its own."""
        return Renewals(
            functools.partial(self._connect, 1),
            self._execute,
            _close_client,
            self.names,
            self._lease_ms,
        )

    async def _read_secret(self, client: Redis) -> bytes:
        """The prefix's secret: created once by the first store that opens it (SET NX, so
        every process and host reads the same one), kept without a TTL."""
        name = self.names.secret
        await client.set(name, token_bytes(SECRET_BYTES), nx=True)
        value = await client.get(name)
        if not isinstance(value, bytes) or len(value) != SECRET_BYTES:
            raise StoreError(f"the Redis key {name!r} is not a porch secret")
        return value

    @property
    def secret(self) -> bytes:
        """The prefix's secret (see :attr:`porch.store.base.Store.secret`)."""
        if self._secret is None:
            raise StoreError(f"the Redis store (prefix {self.prefix}) is not open")
        return self._secret

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        group, self._group = self._group, None
        if group is not None:
            self._transactions += group.pipelines
        await self.claims.stop()
        # Waiters elsewhere need not wait out the lease of a process that is leaving: its
        # claims are released (on the heartbeat's own client and loop: whatever loop this is).
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            await heartbeat.close()
        keeper, self._keeper = self._keeper, None
        if keeper is not None and self._closing is not None:
            if keeper.get_loop() is asyncio.get_running_loop():
                self._closing.set()
                await asyncio.wait({keeper}, timeout=2 * _CLOSE_TIMEOUT)
            # Still running: cancelled. Of a loop that stopped (the pool moved to this one):
            # cancelled, never awaited; its clients' connections belong to that loop. One
            # that shut down cancelled the keeper, which closed them there; one that only
            # stopped closes them if it runs again.
            await stop_task(keeper)

    def admin(self) -> RedisAdmin:
        """The operator's view of this prefix (``porch inspect|reset|purge|check``)."""
        from .admin import RedisAdmin

        location = f"{redact(self.url)} (prefix {self.prefix})"
        return RedisAdmin(self._connect, _close_client, self.names, location, self.clock)

    def statistics(self) -> StoreStatistics:
        pipelines = self._transactions + (self._group.pipelines if self._group else 0)
        return StoreStatistics(pipelines, self._operations, self._failures)

    # -- applying a batch ----------------------------------------------------------

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        group = self._group
        if group is None:
            raise StoreError("the Redis store is not open")
        # Alike hits (one client of one rule) go as one script call with a count.
        sent, alike = collapse_hits(ops)
        names, lease_ms, clock = self.names, self._lease_ms, self.clock
        now = None if clock is None else clock.monotonic()
        wall = None if clock is None else clock.wall()
        started = asyncio.get_running_loop().time()
        try:
            results = await group.run(
                [command(names, lease_ms, op, alike.get(i), now) for i, op in enumerate(sent)]
            )
            for result in results:
                if isinstance(result, Exception):
                    raise StoreError(f"Redis store {redact(self.url)}: {result}")
        except StoreError:
            self._failures += 1
            let_lapse(self._held, ops)  # nobody will end what it took or was ending
            raise
        self._operations += len(ops)
        for i, (op, result) in enumerate(zip(sent, results, strict=True)):
            fill_from_reply(self._held, op, result, alike.get(i), wall)
        if self._heartbeat is not None:
            await confirm_late(self._heartbeat, sent, started)

    async def _execute_now(self, commands: list[Command]) -> list[Any]:
        """``commands`` as one pipeline of their own, on the store's client."""
        client = self._client
        if client is None:
            raise StoreError("the Redis store is not open")
        return await self._execute(client, commands)

    async def _delete(self, name: bytes) -> None:
        client = self._client
        if client is None:
            raise StoreError("the Redis store is not open")
        await client.delete(name)

    async def _execute(self, client: Redis, commands: list[Command]) -> list[Any]:
        """Send ``commands`` as one pipeline and check every reply."""
        results = await self._send(client, commands)
        for result in results:
            if isinstance(result, Exception):
                raise StoreError(f"Redis store {redact(self.url)}: {result}")
        return results

    async def _send(self, client: Redis, commands: list[Command]) -> list[Any]:
        """One pipeline; scripts the server lost are loaded and rerun; per-command errors kept."""
        from redis.exceptions import NoScriptError

        try:
            results = await self._pipeline(client, commands)
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                # Only the commands refused with NOSCRIPT are rerun: they did not run.
                logger.info("porch: Redis lost porch's scripts (NOSCRIPT); loading them again")
                await self._load_scripts(client)
                again = await self._pipeline(client, [commands[i] for i in missing])
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
        except Exception as exc:
            raise StoreError(redact(f"Redis store {self.url}: {exc!r}")) from exc
        return results

    async def _pipeline(self, client: Redis, commands: list[Command]) -> list[Any]:
        packed = wire.pack(commands, self._heads)
        return await wire.run(client.connection_pool, packed, len(commands))

    async def _load_scripts(self, client: Redis) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for script in self._scripts.values():
                pipe.script_load(script.source)
            loaded = await pipe.execute()
        for script, sha in zip(self._scripts.values(), loaded, strict=True):
            if (sha.decode() if isinstance(sha, bytes) else sha) != script.sha:
                raise StoreError(f"Redis loaded script {script.name} under an unexpected SHA")


def _same(key: str) -> str:
    return key


async def _keep(closing: asyncio.Event, client: Redis, subscriber: Redis) -> None:
    """Hold the store's clients on the loop they connect on; close them there, at close()
    or when that loop shuts down (its runner cancels every task, this one too)."""
    try:
        await closing.wait()
    finally:
        await _close_client(subscriber)
        await _close_client(client)


async def _close_client(client: Any) -> None:
    """Close ``client`` (a Redis or a RedisCluster one), bounded, and a Redis client's pool:
    each client here is made over a pool of its own (``_connect``), which redis-py's
    ``aclose()`` does not close (it closes only a pool it made itself); a connection left
    open warns when the collector finds it."""
    from redis.asyncio import Redis

    try:
        async with asyncio.timeout(_CLOSE_TIMEOUT):
            await client.aclose()
            if isinstance(client, Redis):
                await client.connection_pool.disconnect()
    except Exception as exc:  # closing a broken connection: nothing left to save
        logger.debug("porch: closing a Redis client: %r", exc)
