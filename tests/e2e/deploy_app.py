"""The app of the deployment recipes (docs/deployment.md), served by tests/e2e/test_deployment.py.

Its client identity is the documented one for the recipe under test:
``PORCH_TRUSTED_PROXIES`` (comma-separated; e.g. ``unix`` behind nginx on a unix
socket, ``127.0.0.1`` behind nginx on loopback) or, unset, the peer address.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from porch import ClientIdentity, KeyPool, Limit, RateLimitMiddleware, Rule, SQLiteStore

LIMIT = 5

trusted = [p for p in os.environ.get("PORCH_TRUSTED_PROXIES", "").split(",") if p]
identity = ClientIdentity(trusted_proxies=trusted) if trusted else ClientIdentity()
pool = KeyPool(SQLiteStore(os.environ["PORCH_DATA"]))


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


app = Starlette(routes=[Route("/hello", hello), Route("/health", health)])
app.add_middleware(
    RateLimitMiddleware, pool=pool, rules=Rule(Limit(LIMIT, 60), path="/hello"), key=identity
)
