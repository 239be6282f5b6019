"""The storefront app: its routes, wrapped in porch's rate limiter and idempotent checkout.

uvicorn builds it in each worker process with :func:`create_app_from_env`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .._asgi import adding_headers
from .._types import ASGIApp, Receive, Scope, Send
from ..idempotency._keys import CallerScope
from ..idempotency._middleware import DEFAULT_QUOTA, IdempotencyMiddleware, IdempotencyRule
from ..idempotency._policy import IdempotencyPolicy
from ..identity import ClientIdentity
from ..integrations.starlette import install
from ..metrics import PorchMetrics
from ..pool._pool import KeyPool
from ..ratelimit._middleware import RateLimitMiddleware
from ..store.base import Quota
from .checks import (
    MAX_BODY,
    BodyCap,
    TooLarge,
    page_args,
    parse_order,
    problem_response,
    read_capped,
    unavailable,
)
from .completions import completions_route
from .config import DemoConfig
from .exports import export_route, quota_bytes
from .orders import Orders
from .policies import rate_rules
from .webhooks import webhook_routes

__all__ = ["PRODUCTS", "create_app", "create_app_from_env"]

logger = logging.getLogger("porch.demo")

PRODUCTS = (
    {"id": "tea", "name": "Porch tea", "price_cents": 450},
    {"id": "chair", "name": "Rocking chair", "price_cents": 12900},
    {"id": "lamp", "name": "Porch lamp", "price_cents": 3900},
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
            body = await read_capped(request, MAX_BODY)
        except TooLarge:
            logger.info(
                "porch demo: refused an order body over %d bytes (413)",
                MAX_BODY,
                extra={"outcome": "too_large", "status": 413},
            )
            return problem_response(413, f"a request body may be at most {MAX_BODY} bytes")
        parsed = parse_order(body)
        if isinstance(parsed, JSONResponse):
            return parsed
        item, qty = parsed
        if config.checkout_latency:
            await asyncio.sleep(config.checkout_latency)  # the payment provider
        try:
            order_id = await orders.insert(item, qty)
        except sqlite3.Error as exc:
            return unavailable(exc)
        return JSONResponse({"id": order_id, "item": item, "qty": qty}, status_code=201)

    async def list_orders(request: Request) -> JSONResponse:
        args = page_args(request.scope.get("query_string", b"").decode("latin-1"))
        if isinstance(args, JSONResponse):
            return args
        after, limit = args
        try:
            total, rows = await orders.page(after, limit + 1)
        except sqlite3.Error as exc:
            return unavailable(exc)
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
    app.router.routes.extend(webhook_routes(pool, orders, config))
    app.router.routes.append(export_route())
    app.router.routes.append(completions_route(config))
    # One identity for both: an anonymous caller's keys are scoped to the client the
    # limiter counts, so no two clients see each other's keys.
    identity = ClientIdentity(trust_hops=config.trust_proxy_hops)
    # Starlette wraps the last-added middleware outermost: the limiter sees every
    # request first (replays count too), then idempotency guards checkout.
    policy = IdempotencyPolicy(max_body=MAX_BODY, max_stored=config.max_stored)
    app.add_middleware(
        IdempotencyMiddleware,
        pool=pool,
        rules=[
            # An order is JSON: a retry that re-serialises it (other key order, other
            # whitespace) is the same order; another value is still a 422.
            IdempotencyRule("/orders", methods=["POST"], policy=policy.replace(fingerprint="json")),
            IdempotencyRule("/exports", methods=["POST"], policy=policy),
        ],
        # A caller may keep at least two of the largest responses stored.
        quota=Quota(
            scope_bytes=quota_bytes(config.max_stored, DEFAULT_QUOTA.scope_bytes),
            total_bytes=max(DEFAULT_QUOTA.total_bytes, 4 * quota_bytes(config.max_stored, 0)),
            client_bytes=quota_bytes(config.max_stored, DEFAULT_QUOTA.client_bytes),
        ),
        scope=CallerScope(identity=identity),
    )
    key, rules = rate_rules(config, identity)
    app.add_middleware(
        RateLimitMiddleware,
        pool=pool,
        rules=rules,
        key=key,
        # /completions counts tokens, by its own route limit.
        exempt=("/health", "/metrics", "/completions"),
    )
    app.state.pool = pool
    # The route limits (POST /completions' token budget) count through the same pool,
    # keyed alike; the app-level middlewares open and close the pool.
    install(app, pool, key=identity, manage_pool=False)
    # No trailing-slash redirects: the redirect URL is built by decoding the query
    # string as UTF-8, so "GET /orders/?\x80" answered 500 (found by tests/demo/test_fuzz.py).
    app.router.redirect_slashes = False
    # A declared body over the cap is refused before anything reads or counts it.
    app.add_middleware(BodyCap, cap=MAX_BODY)
    if config.worker_header:
        # Outermost: every response, replays and refusals included, names the worker
        # process that served it, so multi-worker runs can be checked from outside. Off
        # by default: a process id tells a client more about the host than it needs.
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
