"""The apps the benchmark serves: one hello-world route, bare or behind porch.

Selected by the environment (uvicorn builds the app in the server process):
``BENCH_VARIANT`` names the variant, ``BENCH_DATA`` the data directory.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from porch import (
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)

VARIANTS = ("bare", "limiter", "limiter-power", "idempotency")

# Far above anything a run can send: the limiter counts every request, refuses none.
HUGE = 1_000_000_000


def create() -> Starlette:
    variant = os.environ.get("BENCH_VARIANT", "bare")
    data = os.environ.get("BENCH_DATA", "./bench-data")
    pools: list[KeyPool] = []

    async def hello(request: Request) -> Response:
        return PlainTextResponse("Hello, world!")

    async def order(request: Request) -> Response:
        body = await request.body()
        return JSONResponse({"id": 1, "size": len(body)}, status_code=201)

    async def stats(request: Request) -> Response:
        transactions = operations = calls = 0
        for pool in pools:
            s = pool.statistics()
            transactions += s.store.transactions
            operations += s.store.operations
            calls += s.calls
        return JSONResponse(
            {"transactions": transactions, "operations": operations, "calls": calls}
        )

    app = Starlette(
        routes=[
            Route("/", hello),
            Route("/orders", order, methods=["POST"]),
            Route("/__stats", stats),
        ]
    )
    if variant in ("limiter", "limiter-power"):
        durability = "power" if variant == "limiter-power" else "process"
        pool = KeyPool(SQLiteStore(data, durability=durability))
        pools.append(pool)
        app.add_middleware(
            RateLimitMiddleware,
            pool=pool,
            rules=Rule(Limit(HUGE, 3600)),
            exempt=("/__stats",),
        )
    elif variant == "idempotency":
        pool = KeyPool(SQLiteStore(data))
        pools.append(pool)
        app.add_middleware(
            IdempotencyMiddleware, pool=pool, rules=IdempotencyRule("/orders", methods=["POST"])
        )
    elif variant != "bare":
        raise SystemExit(f"unknown BENCH_VARIANT {variant!r}; one of {VARIANTS}")
    return app
