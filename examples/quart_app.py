"""Quart behind porch: a rate-limited page and idempotent orders, scoped to the API key's user.

Run: uvicorn examples.quart_app:app --no-proxy-headers   (or hypercorn)
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from quart import Quart, request

from porch import CallerScope, IdempotencyRule, Limit, Rule
from porch.integrations.quart import Porch

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


app = Quart(__name__)


@app.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}


@app.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}


@app.post("/orders")
async def create_order() -> tuple[dict[str, Any], int]:
    user = USERS.get(request.headers.get("X-API-Key", ""), "anonymous")
    await asyncio.sleep(float(os.environ.get("CHECKOUT_DELAY", "0")))  # a payment provider, say
    order = record_order(user, await request.get_data(as_text=False))
    return {"order": order, "user": user, "receipt": uuid.uuid4().hex}, 201


# porch as a Quart extension, configured from app.config: the pool opens before the app
# serves and closes after it.
app.config.update(
    PORCH_DATA_DIR=str(DATA),
    PORCH_RULES=[
        Rule(Limit(int(os.environ.get("HELLO_LIMIT", "5")), 60, name="hello"), path="/hello")
    ],
    PORCH_IDEMPOTENCY=[IdempotencyRule("/orders")],
    PORCH_IDEMPOTENCY_OPTIONS={"scope": user_scope},
)
porch = Porch(app)
