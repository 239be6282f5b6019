"""The admin protocol on PostgreSQL: one connection per command, the server's clock.

Windows and expiries are server time (Unix seconds from ``clock_timestamp()``),
as the store decides them (a store given a test clock decides its counters on that
clock, and its admin reads them on it too). ``purge`` deletes what the store's own bounded
pruning would, through the same function and in the same lock order (a usage
slot, then rows by key, skipping rows a batch holds), keeping the byte
accounting exact; ``check`` reads in one read-only
repeatable-read transaction and changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ...clock import Clock
from ...errors import StoreError
from ..admin import US, CheckReport, CounterInfo, PurgeReport, ResponseInfo, split_counter_key
from ..urls import redact
from .schema import SCHEMA_VERSION, quote_schema

__all__ = ["PostgresAdmin"]

_NOW = "extract(epoch FROM clock_timestamp())"
_TABLES = ("migrations", "counters", "records", "usage", "usage_total", "meta", "client_usage")


# Each one statement (one snapshot: a batch commits its rows and its slot together), the
# difference between the rows and the slots added to the caller's slot ($1).
_REPAIRS = (
    """
    INSERT INTO {s}.usage AS u (scope, slot, bytes)
        SELECT coalesce(r.scope, g.scope), $1, coalesce(r.b, 0) - coalesce(g.b, 0)
        FROM (SELECT scope, sum(size) AS b FROM {s}.records WHERE scope IS NOT NULL
              GROUP BY scope) r
        FULL JOIN (SELECT scope, sum(bytes) AS b FROM {s}.usage GROUP BY scope) g
            ON g.scope = r.scope
        WHERE coalesce(r.b, 0) <> coalesce(g.b, 0)
        ON CONFLICT (scope, slot) DO UPDATE SET bytes = u.bytes + excluded.bytes
    """,
    """
    INSERT INTO {s}.client_usage AS u (client, slot, bytes)
        SELECT coalesce(r.client, g.client), $1, coalesce(r.b, 0) - coalesce(g.b, 0)
        FROM (SELECT client, sum(size) AS b FROM {s}.records WHERE client IS NOT NULL
              GROUP BY client) r
        FULL JOIN (SELECT client, sum(bytes) AS b FROM {s}.client_usage GROUP BY client) g
            ON g.client = r.client
        WHERE coalesce(r.b, 0) <> coalesce(g.b, 0)
        ON CONFLICT (client, slot) DO UPDATE SET bytes = u.bytes + excluded.bytes
    """,
    """
    UPDATE {s}.usage_total SET bytes = bytes
        + (SELECT coalesce(sum(size), 0) FROM {s}.records)
        - (SELECT coalesce(sum(bytes), 0) FROM {s}.usage_total)
        WHERE slot = $1
    """,
)


class PostgresAdmin:
    """:class:`~porch.store.admin.StoreAdmin` for one PostgreSQL schema."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        close: Callable[[Any], Awaitable[None]],
        schema: str,
        location: str,
        clock: Clock | None = None,
    ) -> None:
        # A new connection to the store's database, each statement on it with a deadline.
        self._connect = connect
        self._close = close  # bounded: a server that does not answer has it terminated
        self.s = quote_schema(schema)
        self.location = location
        self._clock = clock  # the store's test clock, which its counters are on (or None)

    def _counters_now(self) -> str:
        """The counters' time in SQL: the server's, or the store's test clock's (a float,
        written as a literal)."""
        return _NOW if self._clock is None else f"{float(self._clock.monotonic())!r}::float8"

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Any]:
        """A new connection to a porch schema, closed after the command; what fails in
        the command is a StoreError naming the store (its password redacted)."""
        conn = await self._connect()
        try:
            if await self._version(conn) is None:
                raise StoreError(f"{self.location}: no porch schema here")
            try:
                yield conn
            except Exception as exc:
                raise StoreError(redact(f"{self.location}: {exc}")) from exc
        finally:
            await self._close(conn)

    async def _version(self, conn: Any) -> int | None:
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{self.s}.migrations")
        if not exists:
            return None
        found = await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {self.s}.migrations")
        return int(found)

    async def counters(self, *, client: str | None = None, most: int = 1000) -> list[CounterInfo]:
        now = self._counters_now()
        async with self._session() as conn:
            rows = await conn.fetch(
                f"SELECT key, count, expires - {now} AS left FROM {self.s}.counters"
                f" WHERE expires > {now} AND count > 0"
                + (" AND right(key, length($2) + 1) = chr(31) || $2" if client else "")
                + " ORDER BY key LIMIT $1",
                most,
                *([client] if client else []),
            )
        found = []
        for row in rows:
            parts = split_counter_key(row["key"])
            if parts is not None:
                found.append(
                    CounterInfo(parts[2], parts[0], parts[1], int(row["count"]), float(row["left"]))
                )
        return found

    async def responses(self, *, client: str | None = None, most: int = 1000) -> list[ResponseInfo]:
        async with self._session() as conn:
            rows = await conn.fetch(
                f"SELECT key, scope, status, size, expires - {_NOW} AS left, expires"
                f" FROM {self.s}.records WHERE status IS NOT NULL AND expires > {_NOW}"
                + (" AND scope = $2" if client else "")
                + " ORDER BY key LIMIT $1",
                most,
                *([f"client:{client}"] if client else []),
            )
        return [
            ResponseInfo(
                row["scope"] or "",
                row["key"].split(US, 1)[1] if US in row["key"] else row["key"],
                int(row["status"]),
                int(row["size"]),
                float(row["left"]),
                float(row["expires"]),
            )
            for row in rows
        ]

    async def reset(self, *, client: str, rule: str | None = None) -> int:
        low, high = (f"rl{US}{rule}{US}", f"rl{US}{rule}\x20") if rule else ("rl" + US, "rl\x20")
        async with self._session() as conn:
            status = await conn.execute(
                f"DELETE FROM {self.s}.counters WHERE key >= $1 AND key < $2"
                " AND right(key, length($3) + 1) = chr(31) || $3",
                low,
                high,
                client,
            )
        return int(status.split()[-1])

    async def forget(self, *, scope: str, key: str) -> int:
        async with self._session() as conn:
            # Expired now: lookups and claims read it as absent, the prunes reclaim its
            # bytes; the row (and its fence token) stays until then.
            status = await conn.execute(
                f"UPDATE {self.s}.records SET expires = {_NOW} WHERE key = $1"
                f" AND status IS NOT NULL AND expires > {_NOW}",
                scope + US + key,
            )
        return int(status.split()[-1])

    async def purge(self) -> PurgeReport:
        s = self.s
        async with self._session() as conn, conn.transaction():
            # The store's own lock order: a usage slot first, then rows by key,
            # skipping rows a batch holds (they are its to touch).
            slot = await conn.fetchval(
                f"SELECT slot FROM {s}.usage_total ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED"
            )
            if slot is None:
                slot = await conn.fetchval(
                    f"SELECT slot FROM {s}.usage_total WHERE slot = 0 FOR UPDATE"
                )
            counters = await conn.execute(
                f"DELETE FROM {s}.counters WHERE key IN (SELECT key FROM {s}.counters"
                f" WHERE expires <= {self._counters_now()} FOR UPDATE SKIP LOCKED)"
            )
            responses = await conn.fetchval(
                f"SELECT {s}.prune_responses_v2({_NOW}, $1, NULL, NULL, NULL, 2147483647)",
                slot,
            )
            # Claims whose holder died long ago and nobody took over (their reservations).
            await conn.fetchval(
                f"SELECT {s}.prune_claims_v1({_NOW} - 60, $1, NULL, NULL, NULL, 2147483647)",
                slot,
            )
            # Bodies streamed in parts that are no longer kept (their parts go with them).
            await conn.execute(
                f"DELETE FROM {s}.bodies WHERE id IN (SELECT id FROM {s}.bodies"
                f" WHERE expires < {_NOW} FOR UPDATE SKIP LOCKED)"
            )
            # The byte totals recomputed from the rows, through this slot: what hosts of
            # an earlier porch (apply_v2) removed without taking off its client's.
            for statement in _REPAIRS:
                await conn.execute(statement.format(s=s), slot)
        return PurgeReport(int(counters.split()[-1]), int(responses))

    async def check(self) -> CheckReport:
        try:
            conn = await self._connect()
        except StoreError as exc:
            return CheckReport(self.location, 0, SCHEMA_VERSION, (str(exc),))
        problems: list[str] = []
        version = 0
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                found = await self._version(conn)
                if found is None:
                    return CheckReport(self.location, 0, SCHEMA_VERSION, ("no porch schema here",))
                version = found
                if version != SCHEMA_VERSION:
                    problems.append(f"schema version {version}, expected {SCHEMA_VERSION}")
                for table in _TABLES:
                    if not await conn.fetchval(
                        "SELECT to_regclass($1) IS NOT NULL", f"{self.s}.{table}"
                    ):
                        problems.append(f"missing table {table}")
                if not problems:
                    # Stored responses and the reservations of claims alike.
                    stored = await conn.fetchval(
                        f"SELECT coalesce(sum(size), 0) FROM {self.s}.records"
                    )
                    total = await conn.fetchval(
                        f"SELECT coalesce(sum(bytes), 0) FROM {self.s}.usage_total"
                    )
                    if int(stored) != int(total):
                        problems.append(f"stored-bytes total {total} != {stored} in records")
                    if await conn.fetchval(
                        f"SELECT count(*) FROM {self.s}.counters WHERE count < 0"
                    ):
                        problems.append("counters with a negative count")
        except Exception as exc:
            problems.append(str(exc))
        finally:
            await self._close(conn)
        return CheckReport(self.location, version, SCHEMA_VERSION, tuple(problems))

    async def close(self) -> None:
        return None
