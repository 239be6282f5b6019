"""FastAPI behind porch: a rate-limited page and idempotent orders, scoped to the API key's user,
and a page limited per user, keyed by the app's own user dependency.

Run: uvicorn examples.fastapi_app:app --no-proxy-headers
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request

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
from porch.integrations.fastapi import RateLimit, install

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


router = APIRouter()


@router.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}


@router.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}


@router.post("/orders", status_code=201)
async def create_order(request: Request, x_api_key: str = Header("")) -> dict[str, Any]:
    user = USERS.get(x_api_key, "anonymous")
    await asyncio.sleep(float(os.environ.get("CHECKOUT_DELAY", "0")))  # a payment provider, say
    order = record_order(user, await request.body())
    return {"order": order, "user": user, "receipt": uuid.uuid4().hex}


async def current_user(x_api_key: str = Header("")) -> str | None:
    """The app's auth: the API key's user, None for none (FastAPI resolves it once per request)."""
    return USERS.get(x_api_key)


async def user_key(user: str | None = Depends(current_user)) -> str | None:
    return f"user:{user}" if user else None  # None: counted by address


@router.get("/me", dependencies=[Depends(RateLimit("3/minute", key=Depends(user_key)))])
async def me(user: str | None = Depends(current_user)) -> dict[str, str | None]:
    return {"user": user}


def create_app(pool: KeyPool) -> FastAPI:
    """The app over ``pool`` (its tests hand it porch.testing's throwaway pool)."""
    app = FastAPI()
    app.include_router(router)
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
    install(app, pool)  # the route limits (GET /me)
    return app


app = create_app(KeyPool(SQLiteStore(DATA)))
