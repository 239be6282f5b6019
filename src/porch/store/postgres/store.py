"""The PostgreSQL store: several hosts share counters, stored responses and claims.

One round trip per batch: every queued batch (a shard's drain; batches of
several shards that queue while the connections are busy are coalesced) is
sent as ONE call of the server-side function ``<schema>.apply_v4`` (a batch
of hits and settles alone: the leaner ``hits_v2``, see hits.py) in autocommit mode, which
is one transaction. The function locks every row it touches in
one global order, reads the server's clock, and decides each operation in
arrival order; window arithmetic therefore uses the database server's clock,
never an app host's.

What frees a claim whose holder died: its lease. A claim is a row with a fence
token (from a sequence: strictly increasing) and ``lease_until`` in server
time, renewed every ``lease / 3`` seconds for every claim this process holds,
in one statement, by a heartbeat thread with a connection of its own (see
:mod:`porch.store._leases`: a blocked event loop does not stop it). A holder
that crashes, is frozen (SIGSTOP) or is cut off stops renewing, and its key can
be claimed again ``lease`` seconds (default 3) after its last renewal; if it
wakes up later, its Save is refused (``"fenced"``) because the key's token moved
on. ``close()`` ends the claims of this process at once.

Availability: connections are opened with ``connect_timeout``, statements run
under a server-side ``statement_timeout``, and every batch also has a
client-side deadline, so a stopped or frozen server makes ``apply`` raise
:class:`~porch.errors.StoreError` within seconds, never hang. A failed
connection is dropped and opened again by the next batch: the store recovers
by itself when the server is back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from ..._tasks import STOP_TIMEOUT, stop_if_cancelled, stop_task
from ...clock import Clock
from ...errors import ConfigurationError, StoreError
from .._leases import CLAIM, Heartbeat, HeldLeases, Lease, confirm_late, let_lapse
from .._watches import Watches
from ..alike import collapse_hits
from ..base import (
    ALGORITHMS,
    PART_GRACE,
    Capabilities,
    Hit,
    Settle,
    StoreOp,
    StoreStatistics,
    Vacate,
)
from ..transport import check_transport
from ..urls import redact
from .claims import Listen, Renewals, key_hash
from .codec import Op, arguments, fill_from_rows
from .hits import fill_counters, hit_arguments
from .parts import PostgresParts
from .schema import migrate, quote_schema, read_secret
from .slots import fill_slot_hits, slot_arguments

if TYPE_CHECKING:
    from .admin import PostgresAdmin

__all__ = ["PostgresStore"]

logger = logging.getLogger("porch.store.postgres")

_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,47}")
_Job = tuple[Sequence[Op], "asyncio.Future[None]"]


def _driver() -> Any:
    try:
        import asyncpg
    except ImportError as exc:
        raise ConfigurationError(
            "the PostgreSQL store needs the asyncpg driver: pip install 'porch[postgres]'"
        ) from exc
    return asyncpg


_TRANSPORT = (
    "SELECT host(inet_server_addr()),"
    " coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)"
)


def _sslmode(url: str) -> str:
    """The sslmode a connection to ``url`` asks for: the URL's, else PGSSLMODE's, else
    libpq's (and asyncpg's) default, ``prefer`` (no certificate check)."""
    asked = parse_qs(urlsplit(url).query).get("sslmode")
    return (asked[-1] if asked else os.environ.get("PGSSLMODE", "prefer")).lower()


class PostgresStore:
    """Counters, stored responses and idempotency claims in PostgreSQL, shared by several hosts.

    ``url``: ``postgresql://user@host:port/database`` (any libpq-style URL
    asyncpg accepts). ``schema``: where porch keeps its tables (created and
    migrated on open). ``lease``: seconds a claim outlives its holder's last
    heartbeat. ``connections``: connections used for batches (plus one that
    listens, and one for the heartbeat while this process holds claims).
    ``connect_timeout`` / ``statement_timeout``: seconds before a batch fails
    with StoreError when the server does not answer.
    ``in_flight``: batches one pool shard keeps out at once (its round trip,
    not the server's work, is what a shard waits on; see ``Capabilities.in_flight``).
    Four: a hot counter's batches queue on its row lock, each held through its
    commit's WAL flush; with four out one is always queued behind the lock
    while the loop answers another's callers, in smaller, steadier bursts
    (measured, limiter-postgres interleaved with two on a loaded box: 0.44 ->
    0.60x bare, loop CPU 57.3 -> 53.3 us per request).

    ``clock``: a test hook. Given one (a ``ManualClock``), hits and settles are decided
    at its ``monotonic()`` time, sent with each batch, instead of at the server's clock
    (and ``Hit.wall`` is its ``wall()``), so a test can move time for the counters;
    claims, leases and stored responses keep the server's clock. Never in production:
    hosts would each decide on their own clock.
    ``part_grace``: seconds after its last part a body streamed in parts that no record
    names (its owner died mid-stream) is deleted (see :class:`~porch.store.base.PartStore`).
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str = "porch",
        lease: float = 3.0,
        connections: int = 4,
        connect_timeout: float = 3.0,
        statement_timeout: float = 4.0,
        prune_batch: int = 64,
        in_flight: int = 4,
        application_name: str = "porch",
        clock: Clock | None = None,
        part_grace: float = PART_GRACE,
    ) -> None:
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigurationError(
                f"url must start with postgresql:// or postgres://, got {url.split('://')[0]!r}"
            )
        if not _SCHEMA.fullmatch(schema):
            raise ConfigurationError(
                f"schema must be a lower-case identifier of at most 48 characters, got {schema!r}"
            )
        if not 0.3 <= lease <= 3600:
            raise ConfigurationError(f"lease must be 0.3-3600 seconds, got {lease}")
        if not 1 <= connections <= 64:
            raise ConfigurationError(f"connections must be 1-64, got {connections}")
        if not 0 < connect_timeout <= 60:
            raise ConfigurationError(f"connect_timeout must be 0-60 seconds, got {connect_timeout}")
        if not 0 < statement_timeout <= 60:
            raise ConfigurationError(
                f"statement_timeout must be 0-60 seconds, got {statement_timeout}"
            )
        if prune_batch < 1:
            raise ConfigurationError(f"prune_batch must be >= 1, got {prune_batch}")
        if not 1 <= in_flight <= 16:
            raise ConfigurationError(f"in_flight must be 1-16, got {in_flight}")
        if not part_grace > 0:
            raise ConfigurationError(f"part_grace must be > 0 seconds, got {part_grace}")
        self._asyncpg = _driver()
        self.url = url
        self.schema = schema
        self.lease = float(lease)
        self.connections = connections
        self.connect_timeout = float(connect_timeout)
        self.statement_timeout = float(statement_timeout)
        self.prune_batch = prune_batch
        self.clock = clock
        # Bodies streamed in parts, on connections of their own.
        self._parts = PostgresParts(
            self._connect,
            quote_schema(schema),
            grace=float(part_grace),
            deadline=self.connect_timeout + self.statement_timeout + 1.0,
        )
        self.capabilities = Capabilities(
            # Four shards, whose batches go out on connections side by side.
            shards=4,
            in_flight=in_flight,
            clock=clock,
            admin=self.admin,
            algorithms=frozenset(ALGORITHMS),
            parts=self._parts,
            # Leases renewed by the heartbeat (slots.py): a dead holder's within `lease`.
            slots=True,
            slot_lease=self.lease,
        )
        self.application_name = application_name
        self.channel = f"porch_claims_{schema}"
        self.claims = Watches(
            Listen(self._connect, self.channel, self.connect_timeout + self.statement_timeout),
            key_hash,
            lease=self.lease,
            logger=logger,
        )
        self._sql = (
            f"SELECT * FROM {quote_schema(schema)}.apply_v4("
            + ", ".join(f"${n}" for n in range(1, 32))
            + ")"
        )
        self._hits_sql = (
            f"SELECT * FROM {quote_schema(schema)}.hits_v2("
            + ", ".join(f"${n}" for n in range(1, 14))
            + ")"
        )
        self._slots_sql = (
            f"SELECT * FROM {quote_schema(schema)}.slot_hits_v1("
            + ", ".join(f"${n}" for n in range(1, 22))
            + ")"
        )
        self._queue: asyncio.Queue[_Job | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop open() ran on
        self._workers: list[asyncio.Task[None]] = []
        self._heartbeat: Heartbeat | None = None
        self._held = HeldLeases()  # the claims this process holds
        self._transport_checked = False
        self._secret: bytes | None = None  # the schema's, read when it is opened
        self._transactions = 0
        self._operations = 0
        self._failures = 0

    @property
    def secret(self) -> bytes:
        """The schema's secret (migration 2; see :attr:`porch.store.base.Store.secret`)."""
        if self._secret is None:
            raise StoreError(f"the PostgreSQL store (schema {self.schema!r}) is not open")
        return self._secret

    # -- connections -------------------------------------------------------------------

    async def _connect(self, command_timeout: float | None = None) -> Any:
        """A new connection. ``command_timeout``: asyncpg's deadline for each statement on
        it (the store's own calls carry their deadlines; the admin's take this one)."""
        try:
            async with asyncio.timeout(self.connect_timeout + 0.5):
                return await self._asyncpg.connect(
                    self.url,
                    timeout=self.connect_timeout,
                    command_timeout=command_timeout,
                    server_settings={
                        "application_name": self.application_name,
                        "statement_timeout": str(int(self.statement_timeout * 1000)),
                        "idle_in_transaction_session_timeout": str(
                            int(self.statement_timeout * 1000)
                        ),
                    },
                )
        except TimeoutError as exc:
            raise StoreError(
                f"PostgreSQL did not accept a connection within {self.connect_timeout:g}s"
            ) from exc
        except (OSError, ValueError, self._asyncpg.PostgresError) as exc:
            # ValueError: asyncpg's ClientConfigurationError (a bad URL parameter).
            raise StoreError(redact(f"cannot connect to PostgreSQL: {exc}")) from exc

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if self._queue is not None:
            return
        conn = await self._connect()
        try:
            async with asyncio.timeout(self.statement_timeout + self.connect_timeout):
                version = await self._prepare(conn)
        except TimeoutError as exc:
            conn.terminate()
            raise StoreError("PostgreSQL did not answer while migrating the schema") from exc
        except self._asyncpg.PostgresError as exc:
            conn.terminate()
            raise StoreError(
                redact(f"cannot migrate the PostgreSQL schema {self.schema!r}: {exc}")
            ) from exc
        except BaseException:
            conn.terminate()
            raise
        if version == 0:
            logger.info("porch: created the PostgreSQL schema %r", self.schema)
        queue = self._queue = asyncio.Queue()
        loop = self._loop = asyncio.get_running_loop()
        first: list[Any] = [conn]
        for i in range(self.connections):
            worker = self._worker(queue, first.pop() if first else None)
            self._workers.append(loop.create_task(worker, name=f"porch-pg-{i}"))
        self.claims.start()
        self._parts.open()
        # Leases of their own: a heartbeat left finishing by an earlier close() that was cut
        # short releases only the claims of its time.
        held = self._held = HeldLeases()
        self._heartbeat = Heartbeat(
            held,
            lease=self.lease,
            renewer=lambda: Renewals(self._connect, self._lease_round, self.lease),
            deadline=self.connect_timeout + self.statement_timeout + 1.0,
            name="porch-pg-heartbeat",
            logger=logger,
        )
        self._heartbeat.start()

    async def _prepare(self, conn: Any) -> int:
        """Migrate the schema (the version found before), read its secret, and say once if
        the server is reached from another host without TLS and a certificate check."""
        version = await migrate(conn, self.schema)
        self._secret = await read_secret(conn, self.schema)
        if not self._transport_checked:
            self._transport_checked = True
            # The server's side of this connection: its address (NULL on a unix socket)
            # and whether the connection is TLS, whatever the URL asked for.
            peer, tls = await conn.fetchrow(_TRANSPORT)
            mode = _sslmode(self.url)
            check_transport(
                "PostgreSQL",
                self.url,
                peer,
                tls=bool(tls),
                verified=mode in ("verify-ca", "verify-full"),
                setting="sslmode=verify-full and sslrootcert=<the server's CA>",
            )
        return version

    async def close(self) -> None:
        queue = self._queue
        if queue is None:
            return
        self._queue = None
        workers, self._workers = self._workers, []
        if self._loop is asyncio.get_running_loop():
            for _ in workers:
                queue.put_nowait(None)  # after the batches queued before it
            # Each ends after its batch in flight (bounded by its statement deadline).
            if workers:
                await asyncio.wait(workers, timeout=self.statement_timeout + STOP_TIMEOUT)
        # One still running is cancelled, every error retrieved; of a loop that stopped
        # (the pool moved to this one) they are only cancelled, never awaited: its runner
        # cancelled them as it shut down, which closed their connections.
        for worker in workers:
            await stop_task(worker)
        self._parts.close()
        await self.claims.stop()
        # End this process's claims now, rather than at their lease's end (on the
        # heartbeat's own connection and loop: whatever loop this is).
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            await heartbeat.close()

    def admin(self) -> PostgresAdmin:
        """The operator's view of this schema (``porch inspect|reset|purge|check``)."""
        from .admin import PostgresAdmin

        location = f"{redact(self.url)} (schema {self.schema})"
        # Each statement within the server's statement_timeout, and a little more for a
        # server that does not answer at all: an operator's command never hangs.
        deadline = self.statement_timeout + 1.0
        connect = functools.partial(self._connect, deadline)
        return PostgresAdmin(connect, close_connection, self.schema, location, self.clock)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self._transactions, self._operations, self._failures)

    def held(self) -> dict[str, int]:
        """The claims this process holds and renews (key -> token)."""
        return self._held.of(CLAIM)

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        await self._submit(ops)

    async def _submit(self, ops: Sequence[Op]) -> None:
        queue = self._queue
        if queue is None:
            raise StoreError("the PostgreSQL store is not open")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.put_nowait((ops, future))
        deadline = self.statement_timeout + 1.0
        try:
            async with asyncio.timeout(deadline):
                await asyncio.shield(future)  # a caller that gives up leaves the batch be
        except TimeoutError as exc:
            future.cancel()  # a worker that has not started it skips it
            self._failures += 1
            raise StoreError(f"PostgreSQL did not answer within {deadline:g}s") from exc

    # -- the workers ---------------------------------------------------------------------

    async def _worker(self, queue: asyncio.Queue[_Job | None], conn: Any) -> None:
        try:
            while True:
                stop_if_cancelled()
                job = await queue.get()
                if job is None:
                    return
                jobs = [job]
                stopping = False
                while not queue.empty():  # group commit across shards
                    more = queue.get_nowait()
                    if more is None:
                        stopping = True
                        break
                    jobs.append(more)
                live = [j for j in jobs if not j[1].done()]
                for ops, future in jobs:
                    if future.done():  # its caller gave up before it ran: never sent
                        let_lapse(self._held, ops)
                if live:
                    conn = await self._run(conn, live)
                if stopping:
                    return
        finally:
            if conn is not None:
                await close_connection(conn)

    async def _run(self, conn: Any, jobs: list[_Job]) -> Any:
        ops = [op for job_ops, _ in jobs for op in job_ops]
        error: StoreError | None = None
        try:
            if conn is None or conn.is_closed():
                conn = await self._connect()
            sent, alike = collapse_hits(ops)
            clock = self.clock
            now = None if clock is None else clock.monotonic()
            wall = None if clock is None else clock.wall()
            started = asyncio.get_running_loop().time()
            if any(type(op) is Vacate or (type(op) is Hit and op.slots) for op in ops):
                # Concurrency slots: the counter ops with their slots (slots.py), then the
                # rest, if any, in a second call.
                await self._run_slots(conn, ops, now, wall)
            elif sent and all(type(op) is Hit or type(op) is Settle for op in sent):
                # The limiter's batches: a lean function.
                arguments = hit_arguments(sent, alike, self.prune_batch, now)
                async with asyncio.timeout(self.statement_timeout + 0.5):
                    rows = await conn.fetch(self._hits_sql, *arguments)
                fill_counters(sent, alike, rows, wall)
            else:
                arguments = self._arguments(sent, alike, now)
                async with asyncio.timeout(self.statement_timeout + 0.5):
                    rows = await conn.fetch(self._sql, *arguments)
                fill_from_rows(sent, alike, rows, self._held, wall)
            if self._heartbeat is not None:
                await confirm_late(self._heartbeat, ops, started)
            for job_ops, future in jobs:
                if future.done():  # its caller gave up: nobody knows of its claims
                    let_lapse(self._held, job_ops)
            self._transactions += 1
            self._operations += len(ops)
        except StoreError as exc:
            error = exc
        except TimeoutError:
            error = StoreError(
                f"PostgreSQL did not answer within {self.statement_timeout + 0.5:g}s"
            )
        except Exception as exc:  # driver and server errors alike
            error = StoreError(redact(f"PostgreSQL store: {exc}"))
        if error is not None:
            self._failures += 1
            logger.error("porch: PostgreSQL batch failed: %s", error)
            let_lapse(self._held, ops)  # nobody will end what it took or was ending
            if conn is not None:
                conn.terminate()  # its state is unknown: the next batch reconnects
            conn = None
        for _, future in jobs:
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        return conn

    def _arguments(
        self, ops: list[Op], alike: dict[int, list[Hit]], now: float | None = None
    ) -> list[Any]:
        return arguments(ops, alike, self.lease, self.prune_batch, self.channel, now)

    async def _run_slots(
        self, conn: Any, ops: list[Op], now: float | None, wall: float | None
    ) -> None:
        """A batch holding slot ops: its hits, settles and vacates through slot_hits_v1,
        then its other ops (claims, saves...) through apply_v4."""
        counter_ops: list[Hit | Settle | Vacate] = []
        rest: list[Op] = []
        for op in ops:
            if type(op) is Hit or type(op) is Settle or type(op) is Vacate:
                counter_ops.append(op)
            else:
                rest.append(op)
        sent, alike = collapse_hits(counter_ops)
        arguments = slot_arguments(sent, alike, self.lease, self.prune_batch, now)
        async with asyncio.timeout(self.statement_timeout + 0.5):
            rows = await conn.fetch(self._slots_sql, *arguments)
        fill_slot_hits(sent, alike, rows, wall, self._held)
        if rest:
            async with asyncio.timeout(self.statement_timeout + 0.5):
                rows = await conn.fetch(self._sql, *self._arguments(rest, {}, now))
            fill_from_rows(rest, {}, rows, self._held, wall)

    async def _lease_round(
        self, conn: Any, ops: list[Op], slots: list[Lease], lease: float | None
    ) -> Any:
        """The heartbeat's one statement (see claims.Renewals): the claims' ops through the
        batch function, the slots through slot_leases_v1; rows (kind, number, code)."""
        schema = quote_schema(self.schema)
        parts: list[str] = []
        args: list[Any] = []
        if ops:
            args += self._arguments(ops, {})
            marks = ", ".join(f"${n}" for n in range(1, len(args) + 1))
            parts.append(f"SELECT 0 AS kind, op, code FROM {schema}.apply_v4({marks}) WHERE op > 0")
        if slots:
            n = len(args)
            args += [[s.key for s in slots], [s.token for s in slots], lease]
            parts.append(
                f"SELECT 1, n, ok FROM {schema}.slot_leases_v1(${n + 1}, ${n + 2}, ${n + 3})"
            )
        if not parts:
            return []
        try:
            async with asyncio.timeout(self.statement_timeout + 0.5):
                return await conn.fetch(" UNION ALL ".join(parts), *args)
        except TimeoutError as exc:
            raise StoreError(
                f"PostgreSQL did not answer within {self.statement_timeout + 0.5:g}s"
            ) from exc


async def close_connection(conn: Any) -> None:
    """Close ``conn`` within a second; a server that does not answer has it terminated."""
    try:
        async with asyncio.timeout(1.0):
            await conn.close()
    except Exception:
        conn.terminate()
