"""The storefront demo: a small shop API protected by porch.

``porch demo`` serves it with uvicorn. The app is built by :func:`create_app`
from a :class:`DemoConfig`; worker processes rebuild it from the config that
the CLI passes in the environment. Counters and stored responses live in
``<data-dir>/porch.sqlite3`` by default, or in the store ``--store URL`` names
(shared by several demo processes: several hosts); the shop's own orders are
always this host's, in ``<data-dir>/orders.sqlite3``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ._asgi import adding_headers
from ._files import private_directory, private_file, tighten
from ._types import ASGIApp, Receive, Scope, Send
from .errors import ConfigurationError
from .idempotency import IdempotencyMiddleware, IdempotencyRule
from .idempotency_keys import CallerScope
from .identity import ClientIdentity
from .metrics import PorchMetrics
from .pool import KeyPool
from .ratelimit import RateLimitMiddleware
from .responses import problem
from .rules import Limit, Rule
from .store import SQLiteStore, Store, open_store
from .store.base import Durability

__all__ = ["DemoConfig", "create_app", "create_app_from_env"]

CONFIG_ENV = "PORCH_DEMO_CONFIG"

logger = logging.getLogger("porch.demo")

# The demo validates its own input: an order is small, and nothing a client sends
# may reach SQLite (or json's recursion) unchecked.
# An order names an item of up to 64 KiB (outside checks send such orders, to
# exercise the stored-bytes quota); a body may be a few times that, escaped.
MAX_BODY = 512 * 1024
MAX_ITEM = 64 * 1024
MAX_QTY = 10_000
MAX_PAGE = 1000
DEFAULT_PAGE = 100

PRODUCTS = (
    {"id": "tea", "name": "Porch tea", "price_cents": 450},
    {"id": "chair", "name": "Rocking chair", "price_cents": 12900},
    {"id": "lamp", "name": "Porch lamp", "price_cents": 3900},
)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Everything ``porch demo`` can be told."""

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = "./porch-data"
    limit: int = 60
    window: float = 60.0
    pool_size: int = 4
    mailbox: int = 1024
    checkout_latency: float = 0.0
    trust_proxy_hops: int = 0
    workers: int = 1
    durability: Durability = "process"
    store: str | None = None  # a store URL (see porch.open_store); None: SQLite in data_dir

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigurationError(f"--port must be 0-65535, got {self.port}")
        if self.checkout_latency < 0:
            raise ConfigurationError(
                f"--checkout-latency must be >= 0, got {self.checkout_latency}"
            )
        if self.trust_proxy_hops < 0:
            raise ConfigurationError(
                f"--trust-proxy-hops must be >= 0, got {self.trust_proxy_hops}"
            )
        if self.workers < 1:
            raise ConfigurationError(f"--workers must be >= 1, got {self.workers}")

    def open_store(self) -> Store:
        """The store for counters and stored responses (not opened yet).

        ``--durability`` is the SQLite store's setting; a network store keeps its
        server's own durability.
        """
        if self.store is None:
            return SQLiteStore(self.data_dir, durability=self.durability)
        if self.store.lower().startswith("sqlite:"):
            return open_store(self.store, durability=self.durability)
        return open_store(self.store)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> DemoConfig:
        raw = os.environ.get(CONFIG_ENV)
        return cls(**json.loads(raw)) if raw else cls()


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
            self._local.conn = conn
        return conn

    def _insert(self, item: str, qty: int) -> int:
        cur = self._conn().execute("INSERT INTO orders (item, qty) VALUES (?, ?)", (item, qty))
        return int(cur.lastrowid or 0)

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
        self._executor.shutdown(wait=True)


_TITLES = {
    400: "Bad Request",
    413: "Content Too Large",
    422: "Unprocessable Content",
    503: "Service Unavailable",
}


def _problem(status: int, detail: str, **extensions: str) -> JSONResponse:
    document = {"type": "about:blank", "title": _TITLES[status], "status": status}
    document.update(detail=detail, **extensions)
    return JSONResponse(
        document,
        status_code=status,
        media_type="application/problem+json",
        headers={"retry-after": "1"} if status == 503 else None,
    )


def _unavailable(exc: sqlite3.Error) -> JSONResponse:
    """The orders file failed (disk full, locked): 503 like porch's own store, never a 500."""
    logger.error("porch demo: the orders store failed: %s", exc, extra={"cause": "store"})
    return _problem(503, "the orders store is unavailable", cause="store")


class _TooLarge(Exception):
    """Raised when a request body exceeds MAX_BODY while it is read."""


async def _read_capped(request: Request, cap: int) -> bytes:
    """The body, read chunk by chunk and refused as soon as it passes ``cap``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def parse_order(body: bytes) -> tuple[str, int] | JSONResponse:
    """An order's ``(item, qty)``, or the 400/422 problem that refuses it."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: a deeply nested array; ValueError also covers an
        # integer literal longer than Python's int-parsing limit.
        return _problem(400, "body must be a JSON object")
    if not isinstance(payload, dict):
        return _problem(400, "body must be a JSON object")
    item, qty = payload.get("item"), payload.get("qty")
    if not isinstance(item, str) or not item:
        return _problem(422, "'item' must be a non-empty string")
    if len(item) > MAX_ITEM:
        return _problem(422, f"'item' must be at most {MAX_ITEM} characters")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a JSON escape
        return _problem(422, "'item' must be valid Unicode text (no lone surrogates)")
    if isinstance(qty, bool) or not isinstance(qty, int) or not 1 <= qty <= MAX_QTY:
        return _problem(422, f"'qty' must be an integer from 1 to {MAX_QTY}")
    return item, qty


def _page_args(query: str) -> tuple[int, int] | JSONResponse:
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=False, max_num_fields=20)
    except ValueError:
        return _problem(400, "too many query parameters")
    values: dict[str, int] = {}
    for name, default, low, high in (
        ("after", 0, 0, 2**63 - 1),
        ("limit", DEFAULT_PAGE, 1, MAX_PAGE),
    ):
        raw = params.get(name, [str(default)])
        text = raw[-1].strip()
        if len(raw) != 1 or not text.isascii() or not text.isdigit() or len(text) > 19:
            return _problem(400, f"'{name}' must be one integer from {low} to {high}")
        number = int(text)
        if not low <= number <= high:
            return _problem(400, f"'{name}' must be one integer from {low} to {high}")
        values[name] = number
    return values["after"], values["limit"]


def create_app(config: DemoConfig | None = None) -> Starlette:
    """The storefront, wrapped in porch's rate limiter and idempotent checkout."""
    config = config or DemoConfig()
    data = Path(config.data_dir)
    orders = Orders(data / "orders.sqlite3")

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def products(request: Request) -> JSONResponse:
        return JSONResponse(list(PRODUCTS))

    async def create_order(request: Request) -> JSONResponse:
        try:
            body = await _read_capped(request, MAX_BODY)
        except _TooLarge:
            logger.info(
                "porch demo: refused an order body over %d bytes (413)",
                MAX_BODY,
                extra={"outcome": "too_large", "status": 413},
            )
            return _problem(413, f"a request body may be at most {MAX_BODY} bytes")
        parsed = parse_order(body)
        if isinstance(parsed, JSONResponse):
            return parsed
        item, qty = parsed
        if config.checkout_latency:
            await asyncio.sleep(config.checkout_latency)  # the payment provider
        try:
            order_id = await orders.insert(item, qty)
        except sqlite3.Error as exc:
            return _unavailable(exc)
        return JSONResponse({"id": order_id, "item": item, "qty": qty}, status_code=201)

    async def list_orders(request: Request) -> JSONResponse:
        args = _page_args(request.scope.get("query_string", b"").decode("latin-1"))
        if isinstance(args, JSONResponse):
            return args
        after, limit = args
        try:
            total, rows = await orders.page(after, limit + 1)
        except sqlite3.Error as exc:
            return _unavailable(exc)
        # ``count`` is every order this host holds; ``orders`` one page of them, and
        # ``next`` the ``after`` that fetches the following page (null on the last).
        following = rows[limit - 1]["id"] if len(rows) > limit else None
        return JSONResponse({"count": total, "orders": rows[:limit], "next": following})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        yield
        orders.close()

    metrics = PorchMetrics()
    app = Starlette(
        routes=[
            Route("/health", health),
            # Prometheus text format; with --workers N, the sum over every worker.
            Route("/metrics", metrics.asgi_app()),
            Route("/products", products),
            Route("/orders", create_order, methods=["POST"]),
            Route("/orders", list_orders, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    pool = KeyPool(
        config.open_store(), size=config.pool_size, mailbox=config.mailbox, metrics=metrics
    )
    # One identity for both: an anonymous caller's keys are scoped to the client the
    # limiter counts, so no two clients see each other's keys.
    identity = ClientIdentity(trust_hops=config.trust_proxy_hops)
    # Starlette wraps the last-added middleware outermost: the limiter sees every
    # request first (replays count too), then idempotency guards checkout.
    app.add_middleware(
        IdempotencyMiddleware,
        pool=pool,
        rules=IdempotencyRule("/orders", methods=["POST"]),
        max_body=MAX_BODY,
        scope=CallerScope(identity=identity),
    )
    app.add_middleware(
        RateLimitMiddleware,
        pool=pool,
        rules=Rule(Limit(config.limit, config.window, name="demo")),
        key=identity,
        exempt=("/health", "/metrics"),
    )
    app.state.pool = pool
    # No trailing-slash redirects: the redirect URL is built by decoding the query
    # string as UTF-8, so "GET /orders/?\x80" answered 500 (found by tests/test_fuzz.py).
    app.router.redirect_slashes = False
    # A declared body over the cap is refused before anything reads or counts it.
    app.add_middleware(_BodyCap, cap=MAX_BODY)
    # Outermost: every response, replays and refusals included, names the worker
    # process that served it, so multi-worker runs can be checked from outside.
    app.add_middleware(_WorkerHeader)
    return app


class _BodyCap:
    """413 for any request whose Content-Length exceeds ``cap``; streamed bodies are
    capped where they are read (the order handler, the idempotency middleware)."""

    def __init__(self, app: ASGIApp, *, cap: int) -> None:
        self.app = app
        self.cap = cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    text = value.strip()
                    if not text.isdigit():
                        await problem(400, "Content-Length must be a decimal integer")(
                            scope, receive, send
                        )
                        return
                    if len(text) > 18 or int(text) > self.cap:
                        logger.info(
                            "porch demo: refused a declared body over %d bytes (413)",
                            self.cap,
                            extra={"outcome": "too_large", "status": 413},
                        )
                        await problem(413, f"a request body may be at most {self.cap} bytes")(
                            scope, receive, send
                        )
                        return
        await self.app(scope, receive, send)


class _WorkerHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.header = (b"x-demo-worker", str(os.getpid()).encode("ascii"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, adding_headers(send, (self.header,)))


def create_app_from_env() -> Starlette:
    """The uvicorn factory used by ``porch demo`` (also in worker processes)."""
    return create_app(DemoConfig.from_env())
