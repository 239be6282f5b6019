"""The storefront demo: a small shop API protected by porch on the embedded SQLite store.

``porch demo`` serves it with uvicorn. The app is built by :func:`create_app`
from a :class:`DemoConfig`; worker processes rebuild it from the config that
the CLI passes in the environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ._asgi import adding_headers
from ._types import ASGIApp, Receive, Scope, Send
from .errors import ConfigurationError
from .idempotency import IdempotencyMiddleware, IdempotencyRule
from .identity import ClientIdentity
from .pool import KeyPool
from .ratelimit import RateLimitMiddleware
from .rules import Limit, Rule
from .store.base import Durability
from .store.sqlite import SQLiteStore

__all__ = ["DemoConfig", "create_app", "create_app_from_env"]

CONFIG_ENV = "PORCH_DEMO_CONFIG"

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
            self.path.parent.mkdir(parents=True, exist_ok=True)
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

    def _list(self) -> list[dict[str, Any]]:
        rows = self._conn().execute("SELECT id, item, qty FROM orders ORDER BY id").fetchall()
        return [{"id": r[0], "item": r[1], "qty": r[2]} for r in rows]

    async def insert(self, item: str, qty: int) -> int:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._insert, item, qty
        )

    async def list(self) -> list[dict[str, Any]]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._list)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _bad_request(detail: str) -> JSONResponse:
    return JSONResponse(
        {"type": "about:blank", "title": "Bad Request", "status": 400, "detail": detail},
        status_code=400,
        media_type="application/problem+json",
    )


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
            payload = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return _bad_request("body must be a JSON object")
        if not isinstance(payload, dict):
            return _bad_request("body must be a JSON object")
        item, qty = payload.get("item"), payload.get("qty")
        if not isinstance(item, str) or not item:
            return _bad_request("'item' must be a non-empty string")
        if isinstance(qty, bool) or not isinstance(qty, int) or qty < 1:
            return _bad_request("'qty' must be an integer >= 1")
        if config.checkout_latency:
            await asyncio.sleep(config.checkout_latency)  # the payment provider
        order_id = await orders.insert(item, qty)
        return JSONResponse({"id": order_id, "item": item, "qty": qty}, status_code=201)

    async def list_orders(request: Request) -> JSONResponse:
        rows = await orders.list()
        return JSONResponse({"count": len(rows), "orders": rows})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        yield
        orders.close()

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/products", products),
            Route("/orders", create_order, methods=["POST"]),
            Route("/orders", list_orders, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    store = SQLiteStore(data, durability=config.durability)
    pool = KeyPool(store, size=config.pool_size, mailbox=config.mailbox)
    # Starlette wraps the last-added middleware outermost: the limiter sees every
    # request first (replays count too), then idempotency guards checkout.
    app.add_middleware(
        IdempotencyMiddleware,
        pool=pool,
        rules=IdempotencyRule("/orders", methods=["POST"]),
    )
    app.add_middleware(
        RateLimitMiddleware,
        pool=pool,
        rules=Rule(Limit(config.limit, config.window, name="demo")),
        key=ClientIdentity(trust_hops=config.trust_proxy_hops),
        exempt=("/health",),
    )
    app.state.pool = pool
    # Outermost: every response, replays and refusals included, names the worker
    # process that served it, so multi-worker runs can be checked from outside.
    app.add_middleware(_WorkerHeader)
    return app


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
