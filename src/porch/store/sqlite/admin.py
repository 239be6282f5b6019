"""The admin protocol on the SQLite file: read and repair it beside running servers.

Every command opens its own connection and never creates the file. ``check``
reads through a read-only connection; the others write in short ``BEGIN
IMMEDIATE`` transactions, waiting for the servers' writers like any of them.
Times in the file are on the monotonic clock of the boot recorded in it; after
a reboot the wall-clock columns are used instead (as the store's rebase does).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ...clock import Clock, SystemClock
from ...errors import StoreError
from ..admin import US, CheckReport, CounterInfo, PurgeReport, ResponseInfo, split_counter_key
from .counters import split_key
from .schema import SCHEMA_VERSION, check_not_foreign

__all__ = ["SQLiteAdmin"]

# The schema version whose counters are rows of ``counts`` under a name (see schema.py).
_COMPACT_COUNTERS = 4
_TABLES = (
    "porch_meta",
    "counter_names",
    "counts",
    "responses",
    "response_bytes",
    "response_total",
    "client_bytes",
    "reservations",
)


class SQLiteAdmin:
    """:class:`~porch.store.admin.StoreAdmin` for one SQLite store file."""

    def __init__(
        self, path: Path, *, clock: Clock | None = None, busy_timeout: float = 5.0
    ) -> None:
        self.path = path
        self.location = str(path)
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.busy_timeout = busy_timeout

    # -- connections --------------------------------------------------------------------

    def _open(self, *, read_only: bool) -> sqlite3.Connection:
        if not self.path.is_file():
            raise StoreError(f"no porch store at {self.path}")
        mode = "ro" if read_only else "rw"
        try:
            conn = sqlite3.connect(
                f"file:{self.path}?mode={mode}",
                uri=True,
                timeout=self.busy_timeout,
                isolation_level=None,
            )
            check_not_foreign(conn)
            (version,) = conn.execute("PRAGMA user_version").fetchone()
        except (sqlite3.Error, StoreError) as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
        if not read_only and version != SCHEMA_VERSION:
            conn.close()
            raise StoreError(
                f"{self.path}: schema version {version}, this porch uses {SCHEMA_VERSION};"
                " start a server on it once (it migrates), or upgrade porch"
            )
        return conn

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One short ``BEGIN IMMEDIATE`` transaction: committed when the block returns."""
        conn = self._open(read_only=False)
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.close()

    def _now(self, conn: sqlite3.Connection) -> tuple[float | None, float]:
        """(monotonic now if the file's times are on this boot's clock, else None; wall now)."""
        row = conn.execute("SELECT value FROM porch_meta WHERE name = 'boot_id'").fetchone()
        same_boot = row is not None and row[0] == self.clock.boot_id()
        return (self.clock.monotonic() if same_boot else None), self.clock.wall()

    # -- the protocol -------------------------------------------------------------------

    async def counters(self, *, client: str | None = None, most: int = 1000) -> list[CounterInfo]:
        return await asyncio.to_thread(self._counters, client, most)

    def _counters(self, client: str | None, most: int) -> list[CounterInfo]:
        conn = self._open(read_only=True)
        try:
            mono, wall = self._now(conn)
            found: list[CounterInfo] = []
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            rows: Iterable[tuple[Any, ...]]
            if version < _COMPACT_COUNTERS:  # not migrated yet: the full key in each row
                rows = (
                    (*split_key(key), *rest)
                    for key, *rest in conn.execute(
                        "SELECT key, count, window_start, expires, wall_start FROM counters"
                        " ORDER BY key"
                    )
                )
            else:  # in key order through the primary keys; a client: one seek per name
                rows = conn.execute(
                    "SELECT n.prefix, c.client, c.count, c.window_start, c.expires, c.wall_start"
                    " FROM counter_names n JOIN counts c ON c.name = n.id"
                    + (" WHERE c.client = ?" if client is not None else "")
                    + " ORDER BY n.prefix, c.client",
                    () if client is None else (client,),
                )
            for prefix, name, count, start, expires, wall_start in rows:
                parts = split_counter_key(prefix + name)
                if parts is None or (client is not None and parts[2] != client):
                    continue
                left = expires - mono if mono is not None else wall_start + (expires - start) - wall
                if left <= 0:
                    continue  # expired: no longer counts, pruned when touched or purged
                found.append(CounterInfo(parts[2], parts[0], parts[1], int(count), left))
                if len(found) >= most:
                    break
            return found
        finally:
            conn.close()

    async def responses(self, *, client: str | None = None, most: int = 1000) -> list[ResponseInfo]:
        return await asyncio.to_thread(self._responses, client, most)

    def _responses(self, client: str | None, most: int) -> list[ResponseInfo]:
        conn = self._open(read_only=True)
        try:
            mono, wall = self._now(conn)
            found: list[ResponseInfo] = []
            rows = conn.execute(
                "SELECT key, scope, status, size, stored_at, expires, stored_wall"
                " FROM responses ORDER BY key"
            )
            for key, scope, status, size, stored_at, expires, stored_wall in rows:
                if client is not None and scope != f"client:{client}":
                    continue
                left = (
                    expires - mono
                    if mono is not None
                    else stored_wall + (expires - stored_at) - wall
                )
                if left <= 0:
                    continue
                name = key.split(US, 1)[1] if US in key else key
                found.append(ResponseInfo(scope, name, int(status), int(size), left, wall + left))
                if len(found) >= most:
                    break
            return found
        finally:
            conn.close()

    async def reset(self, *, client: str, rule: str | None = None) -> int:
        return await asyncio.to_thread(self._reset, client, rule)

    def _reset(self, client: str, rule: str | None) -> int:
        with self._writing() as conn:
            # The client is the key's last field, the rest one of a few names: a lookup each.
            names = [
                name
                for name, prefix in conn.execute("SELECT id, prefix FROM counter_names")
                if (parts := split_counter_key(prefix + client)) is not None
                and parts[2] == client
                and (rule is None or parts[0] == rule)
            ]
            deleted = 0
            for name in names:
                deleted += conn.execute(
                    "DELETE FROM counts WHERE name = ? AND client = ?", (name, client)
                ).rowcount
        return deleted

    async def forget(self, *, scope: str, key: str) -> int:
        return await asyncio.to_thread(self._forget, scope, key)

    def _forget(self, scope: str, key: str) -> int:
        with self._writing() as conn:
            mono, wall = self._now(conn)
            # Expired now (its expiry at its own start): lookups read it as absent, and the
            # prunes reclaim it; the row stays until then, as any expired response's.
            live = "expires > ?" if mono is not None else "stored_wall + (expires - stored_at) > ?"
            return int(
                conn.execute(
                    f"UPDATE responses SET expires = stored_at WHERE key = ? AND {live}",
                    (scope + US + key, mono if mono is not None else wall),
                ).rowcount
            )

    async def purge(self) -> PurgeReport:
        return await asyncio.to_thread(self._purge)

    def _purge(self) -> PurgeReport:
        with self._writing() as conn:
            mono, wall = self._now(conn)
            if mono is not None:
                counters = conn.execute("DELETE FROM counts WHERE expires <= ?", (mono,))
                n_counters = counters.rowcount
                responses = conn.execute("DELETE FROM responses WHERE expires <= ?", (mono,))
            else:
                counters = conn.execute(
                    "DELETE FROM counts WHERE wall_start + (expires - window_start) <= ?",
                    (wall,),
                )
                n_counters = counters.rowcount
                responses = conn.execute(
                    "DELETE FROM responses WHERE stored_wall + (expires - stored_at) <= ?",
                    (wall,),
                )
            n_responses = responses.rowcount
        return PurgeReport(max(0, n_counters), max(0, n_responses))

    async def check(self) -> CheckReport:
        return await asyncio.to_thread(self._check)

    def _check(self) -> CheckReport:
        try:
            conn = self._open(read_only=True)
        except StoreError as exc:
            return CheckReport(self.location, 0, SCHEMA_VERSION, (str(exc),))
        problems: list[str] = []
        version = 0
        try:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version != SCHEMA_VERSION:
                problems.append(f"schema version {version}, expected {SCHEMA_VERSION}")
            tables = {
                name
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            missing = [t for t in _TABLES if t not in tables]
            if missing and version == SCHEMA_VERSION:
                problems.append(f"missing tables: {', '.join(missing)}")
            results = [row[0] for row in conn.execute("PRAGMA integrity_check(20)")]
            if results != ["ok"]:
                problems.append("integrity_check: " + "; ".join(results))
            if not missing and version == SCHEMA_VERSION:
                # Stored responses and the reservations of claims, both counted in the totals.
                (stored,) = conn.execute(
                    "SELECT (SELECT COALESCE(SUM(size), 0) FROM responses)"
                    " + (SELECT COALESCE(SUM(size), 0) FROM reservations)"
                ).fetchone()
                row = conn.execute("SELECT bytes FROM response_total WHERE id = 1").fetchone()
                if row is None or row[0] != stored:
                    problems.append(
                        f"stored-bytes total {row[0] if row else None} != {stored} in responses"
                        " and reservations"
                    )
        except sqlite3.Error as exc:
            problems.append(str(exc))
        finally:
            conn.close()
        return CheckReport(self.location, int(version), SCHEMA_VERSION, tuple(problems))

    async def close(self) -> None:
        return None
