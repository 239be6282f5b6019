"""Flask behind porch (WSGI): a rate-limited page and idempotent orders, scoped to the user.

porch is a Flask extension configured from app.config (porch.integrations.flask); the pool
opens at each worker's first request and closes at the worker's exit.

Run: gunicorn --workers 2 examples.flask_app:app   (sync workers share the store's counts)
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

from flask import Blueprint, Flask, jsonify, request

from porch import CallerScope, IdempotencyRule, Limit, Rule
from porch.integrations.flask import Porch

DATA = Path(os.environ.get("PORCH_DATA", "./porch-data"))
USERS = {"key-alice": "alice", "key-bob": "bob"}  # your API keys -> user ids
anonymous = CallerScope()


def user_scope(scope: dict[str, Any]) -> str:
    """Idempotency keys belong to the API key's user (other callers: porch's default)."""
    api_key = scope["wsgi.environ"].get("HTTP_X_API_KEY", "")
    return "user:" + USERS[api_key] if api_key in USERS else anonymous(scope)


def record_order(user: str, body: bytes) -> int:
    """The side effect that must happen once: a row in this app's own database."""
    with sqlite3.connect(DATA / "orders.sqlite3") as db:
        db.execute("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, user, body)")
        cursor = db.execute("INSERT INTO orders (user, body) VALUES (?, ?)", (user, body))
        return int(cursor.lastrowid or 0)


site = Blueprint("site", __name__)


@site.get("/hello")
def hello() -> Any:
    return jsonify(hello="world")


@site.get("/health")
def health() -> Any:
    return jsonify(ok=True)


@site.post("/orders")
def create_order() -> Any:
    user = USERS.get(request.headers.get("X-API-Key", ""), "anonymous")
    time.sleep(float(os.environ.get("CHECKOUT_DELAY", "0")))  # a payment provider, say
    order = record_order(user, request.get_data())
    return jsonify(order=order, user=user, receipt=uuid.uuid4().hex), 201


def create_app(**config: Any) -> Flask:
    """The app, porch configured from app.config (its tests pass PORCH_STORE=...)."""
    app = Flask(__name__)
    app.register_blueprint(site)
    hello_limit = int(os.environ.get("HELLO_LIMIT", "5"))
    app.config.update(
        PORCH_DATA_DIR=str(DATA),
        PORCH_RULES=[Rule(Limit(hello_limit, 60, name="hello"), path="/hello")],
        PORCH_IDEMPOTENCY=[IdempotencyRule("/orders")],
        PORCH_IDEMPOTENCY_OPTIONS={"scope": user_scope},
    )
    app.config.update(config)
    porch.init_app(app)
    return app


porch = Porch()
app = create_app()
