"""The storefront's own orders: this host's table, in its own SQLite file."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._files import private_directory, private_file, tighten

__all__ = ["Orders"]


class Orders:
    """The storefront's own orders table, in its own SQLite file, written from one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-orders")
        self._local = threading.local()

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            private_directory(self.path.parent)
            private_file(self.path)  # the shop's orders are nobody else's business either
            for suffix in ("", "-wal", "-shm"):
                tighten(self.path.with_name(self.path.name + suffix))
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT,"
                " item TEXT NOT NULL, qty INTEGER NOT NULL)"
            )
            # One row per processing of a webhook event: no unique event id, so a second
            # processing of one event would show as a second row, never be hidden.
            conn.execute(
                "CREATE TABLE IF NOT EXISTS webhooks (row INTEGER PRIMARY KEY AUTOINCREMENT,"
                " event TEXT NOT NULL, amount INTEGER NOT NULL, processed_at TEXT NOT NULL)"
            )
            self._local.conn = conn
        return conn

    def _insert(self, item: str, qty: int) -> int:
        cur = self._conn().execute("INSERT INTO orders (item, qty) VALUES (?, ?)", (item, qty))
        return int(cur.lastrowid or 0)

    def _record_event(self, event: str, amount: int, processed_at: str) -> None:
        self._conn().execute(
            "INSERT INTO webhooks (event, amount, processed_at) VALUES (?, ?, ?)",
            (event, amount, processed_at),
        )

    def _events(self) -> int:
        (count,) = self._conn().execute("SELECT COUNT(*) FROM webhooks").fetchone()
        return int(count)

    async def record_event(self, event: str, amount: int, processed_at: str) -> None:
        """One processing of a webhook event, as a row."""
        await asyncio.get_running_loop().run_in_executor(
            self._executor, self._record_event, event, amount, processed_at
        )

    async def events(self) -> int:
        """How many webhook events this host processed: its rows."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._events)

    def _page(self, after: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        conn = self._conn()
        # One read transaction: the total and the page describe the same moment.
        conn.execute("BEGIN")
        try:
            (total,) = conn.execute("SELECT COUNT(*) FROM orders").fetchone()
            rows = conn.execute(
                "SELECT id, item, qty FROM orders WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
            ).fetchall()
        finally:
            conn.execute("COMMIT")
        return int(total), [{"id": r[0], "item": r[1], "qty": r[2]} for r in rows]

    async def insert(self, item: str, qty: int) -> int:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._insert, item, qty
        )

    async def page(self, after: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """The total number of orders, and up to ``limit`` orders with ids after ``after``."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._page, after, limit
        )

    def close(self) -> None:
        """Close the connection on its thread, then the thread: the last connection to
        close checkpoints the WAL and removes it (a SIGTERM leaves one file, not three)."""
        self._executor.submit(self._close).result(timeout=10.0)
        self._executor.shutdown(wait=True)

    def _close(self) -> None:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            conn.close()
