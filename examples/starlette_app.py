"""Starlette behind porch: a rate-limited page and idempotent orders, scoped to the API key's user.

Run: uvicorn examples.starlette_app:app --no-proxy-headers
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from porch import (
    CallerScope,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)

DATA = Path(os.environ.get("PORCH_DATA", "./porch-data"))
USERS = {"key-alice": "alice", "key-bob": "bob"}  # your API keys -> user ids
anonymous = CallerScope()


def user_scope(scope: dict[str, Any]) -> str:
    """Idempotency keys belong to the API key's user (other callers: porch's default)."""
    for name, value in scope["headers"]:
        if name == b"x-api-key" and value.decode("latin-1") in USERS:
            return "user:" + USERS[value.decode("latin-1")]
    return anonymous(scope)


def record_order(user: str, body: bytes) -> int:
    """The side effect that must happen once: a row in this app's own database."""
    with sqlite3.connect(DATA / "orders.sqlite3") as db:
        db.execute("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, user, body)")
        cursor = db.execute("INSERT INTO orders (user, body) VALUES (?, ?)", (user, body))
        return int(cursor.lastrowid or 0)


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"hello": "world"})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def create_order(request: Request) -> JSONResponse:
    user = USERS.get(request.headers.get("x-api-key", ""), "anonymous")
    await asyncio.sleep(float(os.environ.get("CHECKOUT_DELAY", "0")))  # a payment provider, say
    order = record_order(user, await request.body())
    receipt = {"order": order, "user": user, "receipt": uuid.uuid4().hex}
    return JSONResponse(receipt, status_code=201)


def create_app(pool: KeyPool) -> Starlette:
    """The app over ``pool`` (its tests hand it porch.testing's throwaway pool)."""
    app = Starlette(
        routes=[
            Route("/hello", hello),
            Route("/health", health),
            Route("/orders", create_order, methods=["POST"]),
        ]
    )
    # The last added runs first: limit, then idempotency.
    app.add_middleware(
        IdempotencyMiddleware, pool=pool, rules=IdempotencyRule("/orders"), scope=user_scope
    )
    hello_limit = int(os.environ.get("HELLO_LIMIT", "5"))
    app.add_middleware(
        RateLimitMiddleware,
        pool=pool,
        rules=Rule(Limit(hello_limit, 60, name="hello"), path="/hello"),
    )
    return app


app = create_app(KeyPool(SQLiteStore(DATA)))
