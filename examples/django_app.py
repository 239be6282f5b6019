"""Django behind porch, as WSGI and as ASGI: a rate-limited page and idempotent orders.

One file for brevity (settings, URLs, views); in a project the two entry points
go into your wsgi.py / asgi.py. Idempotency keys are scoped to the API key's user.

Run: gunicorn --workers 2 examples.django_app:wsgi_app           (WSGI, sync workers)
     uvicorn examples.django_app:asgi_app --no-proxy-headers   (ASGI; porch answers the lifespan
     for Django, which has none, and closes its pool when the server stops)
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import django
from django.conf import settings

settings.configure(
    DEBUG=False,
    SECRET_KEY="example-only-not-secret",
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["127.0.0.1", "localhost", "[::1]"],
    MIDDLEWARE=[],
    INSTALLED_APPS=[],
    DATABASES={},
)
django.setup()

from django.core.asgi import get_asgi_application  # noqa: E402 (after settings)
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.http import HttpRequest, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402
from django.views.decorators.http import require_GET, require_POST  # noqa: E402

from porch import (  # noqa: E402
    CallerScope,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch.integrations.wsgi import WSGIMiddleware  # noqa: E402

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


@require_GET
def hello(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"hello": "world"})


@require_GET
def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    user = USERS.get(request.headers.get("X-API-Key", ""), "anonymous")
    time.sleep(float(os.environ.get("CHECKOUT_DELAY", "0")))  # a payment provider, say
    order = record_order(user, request.body)
    receipt = {"order": order, "user": user, "receipt": uuid.uuid4().hex}
    return JsonResponse(receipt, status=201)


urlpatterns = [path("hello", hello), path("health", health), path("orders", create_order)]


def porch_guard(pool: KeyPool) -> Callable[[Any], Any]:
    """The same policy for both entry points: limit /hello, idempotent POST /orders."""
    hello_limit = int(os.environ.get("HELLO_LIMIT", "5"))
    return lambda app: RateLimitMiddleware(
        IdempotencyMiddleware(app, pool=pool, rules=IdempotencyRule("/orders"), scope=user_scope),
        pool=pool,
        rules=Rule(Limit(hello_limit, 60, name="hello"), path="/hello"),
    )


# A process serves one of the two; each has its own pool over the same store directory.
wsgi_pool = KeyPool(SQLiteStore(DATA))
wsgi_app = WSGIMiddleware(get_wsgi_application(), pool=wsgi_pool, wrap=porch_guard(wsgi_pool))
asgi_pool = KeyPool(SQLiteStore(DATA))
asgi_app = porch_guard(asgi_pool)(get_asgi_application())
