"""The apps the benchmarks serve: one hello-world route, bare, behind porch, or behind a peer.

uvicorn builds the app in each server process from the environment:
``BENCH_VARIANT`` names the variant, ``BENCH_DATA`` the data directory,
``BENCH_WINDOW`` the limiter window (seconds), ``BENCH_TRUST_HOPS`` the trusted
proxy hops (for runs that set a different forwarded client per request), and
``BENCH_REDIS`` the Redis URL of the Redis-backed rows (porch's and slowapi's),
``BENCH_POSTGRES`` and ``BENCH_SCHEMA`` the PostgreSQL URL and schema of the
PostgreSQL-backed rows, and ``BENCH_IO_MS`` how long each handler awaits
``asyncio.sleep`` before it answers: a stand-in for a database query, so the
``-io`` rows show the ratio a user with a real app sees. ``BENCH_GC_FREEZE=1``: the
app calls ``gc.freeze()`` once built (the ``-frozen`` rows). ``BENCH_SWITCH_INTERVAL``:
the server process's ``sys.setswitchinterval`` (seconds; Python's default is 0.005), how
long a thread waits for the GIL before the one holding it is asked to let go.
``BENCH_INLINE_OPS``: the SQLite store's ``INLINE_OPS`` in the server (how many hits of
one loop iteration commit on the loop when the writer is idle; the default is that
constant in ``porch/store/sqlite/writer.py``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from porch import (
    ClientIdentity,
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    Quota,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
)
from porch.store.base import Hit, Store, StoreOp

# The policies' names (Concurrency, porch.ratelimit.settle) are imported by their rows only:
# benchmarks/ab.py and hotpath.py run this file over trees from before the policies too.

# The policies' rows (each on SQLite, and with -postgres / -redis on those stores): the
# same one-client rate as the fixed-window limiter, counted another way.
POLICIES = tuple(
    f"limiter-{policy}{store}"
    for policy in ("sliding", "gcra", "levels", "settle")
    for store in ("", "-postgres", "-redis")
)

VARIANTS = (
    "bare",
    "bare-headers",
    "bare-ietf-headers",
    "limiter",
    "limiter-ietf",
    "limiter-nostore",
    "limiter-power",
    "limiter-postgres",
    "limiter-redis",
    "limiter-cluster",  # (BENCH_STORE_URL: redis+cluster://)
    "limiter-sharded",  # (BENCH_STORE_URL: two PostgreSQL URLs)
    "limiter-concurrency",
    "limiter-concurrency-postgres",
    "limiter-concurrency-redis",
    *POLICIES,
    "idempotency",
    "idempotency-postgres",
    "idempotency-redis",
    "slowapi-memory",
    "slowapi-redis",
    "peer-idempotency",
)

LIMITERS = (
    "limiter",
    "limiter-ietf",
    "limiter-ietf-postgres",
    "limiter-ietf-redis",
    "limiter-power",
    "limiter-postgres",
    "limiter-redis",
    "limiter-cluster",  # (BENCH_STORE_URL: redis+cluster://)
    "limiter-sharded",  # (BENCH_STORE_URL: two PostgreSQL URLs)
    "limiter-concurrency",
    "limiter-concurrency-postgres",
    "limiter-concurrency-redis",
    *POLICIES,
)
# The -concurrency rows' cap: above any connection count a run uses, so it refuses
# nothing and the row measures what taking and freeing a slot costs.
CAP = 10_000

# Far above anything a run can send: the limiter counts every request, refuses none.
HUGE = 1_000_000_000

# What the limiter adds to a response, sent by the bare app itself: the cost of the
# headers alone (the server formats and sends them), with no counting at all.
LIMITER_HEADERS = {
    "x-ratelimit-limit": "1000000000",
    "x-ratelimit-remaining": "999999999",
    "x-ratelimit-reset": "1796046686",
    "ratelimit-policy": '"1000000000-per-3600s";q=1000000000;w=3600',
    "ratelimit": '"1000000000-per-3600s";r=999999999;t=3600',
}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _db_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in data.glob("porch.sqlite3*") if p.is_file())


def create() -> Starlette:
    variant = os.environ.get("BENCH_VARIANT", "bare")
    data = Path(os.environ.get("BENCH_DATA", "./bench-data"))
    window = float(os.environ.get("BENCH_WINDOW", "3600"))
    hops = int(os.environ.get("BENCH_TRUST_HOPS", "0"))
    redis_url = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379")
    io = float(os.environ.get("BENCH_IO_MS", "0")) / 1000
    freeze = os.environ.get("BENCH_GC_FREEZE") == "1"
    switch = os.environ.get("BENCH_SWITCH_INTERVAL")
    if switch:
        sys.setswitchinterval(float(switch))
    inline = os.environ.get("BENCH_INLINE_OPS")
    if inline:
        from porch.store.sqlite import writer

        writer.INLINE_OPS = int(inline)
    pools: list[KeyPool] = []

    def store() -> Store:
        url = os.environ.get("BENCH_STORE_URL")
        if url:  # benchmarks/capacity.py: any store porch.open_store opens, by URL(s)
            from porch import open_store

            urls = url.split()
            return open_store(urls if len(urls) > 1 else urls[0])
        if variant.endswith("-postgres"):
            from porch.store.postgres import PostgresStore

            # For A/Bs of the pool's depth and width (ab.py --env).
            depth = os.environ.get("BENCH_PG_IN_FLIGHT")
            width = os.environ.get("BENCH_PG_CONNECTIONS")
            return PostgresStore(
                os.environ["BENCH_POSTGRES"],
                schema=os.environ.get("BENCH_SCHEMA", "porch"),
                **({"in_flight": int(depth)} if depth else {}),
                **({"connections": int(width)} if width else {}),
            )
        if variant.endswith("-redis"):
            from porch.store.redis import RedisStore

            return RedisStore(redis_url, prefix="bench")
        return SQLiteStore(data, durability="power" if variant == "limiter-power" else "process")

    headers = {
        "bare-headers": LIMITER_HEADERS,
        "bare-ietf-headers": {k: v for k, v in LIMITER_HEADERS.items() if k.startswith("rate")},
    }.get(variant)

    async def hello(request: Request) -> Response:
        if io:
            await asyncio.sleep(io)  # the handler's "database query"
        return PlainTextResponse("Hello, world!", headers=headers)

    if variant.startswith("limiter-settle"):
        from porch.ratelimit import settle

    async def hello_settled(request: Request) -> Response:
        # The -settle rows: a reservation of SETTLE_RESERVED, the request reporting it cost
        # 1, so the middleware applies a refund of the difference with every request.
        settle(request, 1)
        return PlainTextResponse("Hello, world!")

    async def order(request: Request) -> Response:
        body = await request.body()
        if io:
            await asyncio.sleep(io)
        return JSONResponse({"id": 1, "size": len(body)}, status_code=201)

    async def stats(request: Request) -> Response:
        totals: dict[str, Any] = {"transactions": 0, "operations": 0, "calls": 0}
        for pool in pools:
            s = pool.statistics()
            totals["transactions"] += s.store.transactions
            totals["operations"] += s.store.operations
            totals["calls"] += s.calls
        # Cyclic-GC passes so far, youngest generation first (see benchmarks/cpu.py).
        totals["gc_collections"] = [g["collections"] for g in gc.get_stats()]
        totals["rss_bytes"] = _rss_bytes()
        totals["db_bytes"] = _db_bytes(data)
        return JSONResponse(totals)

    routes = [
        Route("/", hello_settled if variant.startswith("limiter-settle") else hello),
        Route("/orders", order, methods=["POST"]),
        Route("/__stats", stats),
    ]

    if variant.startswith("slowapi"):
        return _slowapi(routes, hello, "memory://" if variant == "slowapi-memory" else redis_url)

    app = Starlette(routes=routes)
    if variant == "limiter-nostore":
        app.add_middleware(
            RateLimitMiddleware,
            pool=_AnsweringPool(SQLiteStore(data)),
            rules=Rule(Limit(HUGE, window)),
            key=ClientIdentity(trust_hops=hops),
            exempt=("/__stats",),
        )
    elif variant in LIMITERS:
        pool = KeyPool(store())
        pools.append(pool)
        app.add_middleware(
            RateLimitMiddleware,
            pool=pool,
            rules=_rule(variant, window),
            key=ClientIdentity(trust_hops=hops),
            exempt=("/__stats",),
            # Only where it differs: benchmarks/ab.py runs this file over older trees too.
            **({"headers": "ietf"} if variant.startswith("limiter-ietf") else {}),
        )
    elif variant in ("idempotency", "idempotency-postgres", "idempotency-redis"):
        pool = KeyPool(store())
        pools.append(pool)
        app.add_middleware(
            IdempotencyMiddleware,
            pool=pool,
            rules=IdempotencyRule("/orders", methods=["POST"]),
            # wrk is one address with many connections: quotas out of the way (each keyed
            # request still reserves and frees its room, the cost measured).
            quota=_unlimited_quota(),
        )
    elif variant == "peer-idempotency":
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends.memory import MemoryBackend

        app.add_middleware(IdempotencyHeaderMiddleware, backend=MemoryBackend())
    elif variant not in ("bare", "bare-headers", "bare-ietf-headers"):
        raise SystemExit(f"unknown BENCH_VARIANT {variant!r}; one of {VARIANTS}")
    if freeze:
        # What docs/deployment.md recommends: everything built at start-up leaves the
        # collector's generations, so a full collection no longer walks it.
        gc.freeze()
    return app


# What a -settle row reserves with each request before the handler reports 1.
SETTLE_RESERVED = 4


def _rule(variant: str, window: float) -> Rule:
    """The limiter rows' rule: one rate far above the load, counted by the row's policy."""
    policy = variant.removeprefix("limiter-").removesuffix("-postgres").removesuffix("-redis")
    if policy == "concurrency":
        from porch import Concurrency

        return Rule([Limit(HUGE, window), Concurrency(CAP)])
    if policy in ("sliding", "gcra"):
        return Rule(Limit(HUGE, window, algorithm=policy))
    if policy == "levels":
        # Three levels, each its own counter in the one decision: the caller (the client
        # key), its organisation (one for every caller here) and everyone.
        return Rule(
            [
                Limit(HUGE, window),
                Limit(HUGE, window, level="org"),
                Limit(HUGE, window, level="global"),
            ],
            levels={"org": _org},
        )
    if policy == "settle":
        return Rule(Limit(HUGE, window), cost=SETTLE_RESERVED, settle=True)
    return Rule(Limit(HUGE, window))


def _org(scope: Any) -> str:
    return "acme"


def _slowapi(routes: list[Route], hello: Any, storage: str) -> Starlette:
    """slowapi as documented: a Limiter with default limits, and its pure-ASGI middleware
    (the faster of its two; the other is a BaseHTTPMiddleware)."""
    from slowapi import Limiter, _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded
    from slowapi.middleware import SlowAPIASGIMiddleware
    from slowapi.util import get_remote_address

    limiter = Limiter(
        key_func=get_remote_address, default_limits=[f"{HUGE}/hour"], storage_uri=storage
    )
    app = Starlette(routes=routes)
    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]
    app.add_middleware(SlowAPIASGIMiddleware)
    limiter.exempt(routes[2].endpoint)
    return app


class _AnsweringPool(KeyPool):
    """The limiter-nostore row's pool: every hit allowed at once, as if committed, with no
    store, no hop and no thread (its store is never opened). What is left of the limiter's
    cost is its middleware's own: an upper bound for any store (docs/benchmarks.md)."""

    async def start(self) -> None:
        return None

    def apply_now(self, key: str, op: StoreOp) -> bool:
        if not isinstance(op, Hit):
            return False
        op.allowed = True
        op.fits = [True]
        op.remaining = [op.amounts[0] - 1]
        op.next = op.full = op.retry = [float(op.windows[0])]
        op.stamp = [0.0]
        op.wall = time.time()
        return True


def _unlimited_quota() -> Quota:
    """Caps no benchmark reaches (client_bytes only where the tree has it: benchmarks/ab.py
    runs this file over older trees too)."""
    caps = {"scope_bytes": 1 << 50, "total_bytes": 1 << 50}
    if "client_bytes" in getattr(Quota, "__dataclass_fields__", {}):
        caps["client_bytes"] = 1 << 50
    return Quota(**caps)
