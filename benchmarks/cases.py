"""What bench.py measures: each case's app variant, request script (wrk Lua) and baseline."""

from __future__ import annotations

from dataclasses import dataclass, field

from _harness import BODY

GET = ""
POST = f"""
wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
"""
POST_NEW_KEY = f"""
local n = 0
local id = "@NONCE@"  -- fresh per run: the warm-up's keys are never replayed
request = function()
  n = n + 1
  return wrk.format("POST", "/orders", {{["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "k-" .. id .. "-" .. n}}, '{BODY}')
end
"""
POST_SAME_KEY = POST + 'wrk.headers["Idempotency-Key"] = "the-one-key"\n'
# The handler's stand-in for a database query (benchmarks/apps.py): milliseconds awaited.
IO_MS = 2
IO = {"BENCH_IO_MS": str(IO_MS)}
# The app calls gc.freeze() once built (docs/deployment.md, "Tail latency").
FROZEN = {"BENCH_GC_FREEZE": "1"}


@dataclass(frozen=True)
class Case:
    name: str
    variant: str
    lua: str
    baseline: str
    what: str
    path: str = "/"
    workers: int = 1
    redis: str = ""  # "", or the Redis server's appendfsync: "everysec" or "always"
    postgres: bool = False  # a PostgreSQL server on loopback (fsync and synchronous_commit on)
    # Past one store server, passed by URL (BENCH_STORE_URL): "redis-cluster" (the test
    # suite's: 3 primaries, 3 replicas) or "postgres-2" (two PostgreSQL servers, sharded).
    servers: str = ""
    env: dict[str, str] = field(default_factory=dict)


CASES = (
    Case("bare", "bare", GET, "bare", "Starlette hello world, GET /"),
    Case(
        "bare-headers",
        "bare-headers",
        GET,
        "bare",
        "bare app sending the limiter's five headers itself (their cost alone)",
    ),
    Case(
        "bare-ietf-headers",
        "bare-ietf-headers",
        GET,
        "bare",
        "bare app sending the IETF draft's two headers itself (RateLimit-Policy, RateLimit)",
    ),
    Case(
        "limiter-nostore",
        "limiter-nostore",
        GET,
        "bare-headers",
        "porch limiter's middleware over a pool that allows at once: no store, no hop",
    ),
    Case("limiter", "limiter", GET, "bare-headers", "porch limiter, durability=process (default)"),
    Case(
        "limiter-frozen",
        "limiter",
        GET,
        "bare-headers",
        "porch limiter, the app calls gc.freeze() at start-up",
        env=FROZEN,
    ),
    Case(
        "limiter-ietf",
        "limiter-ietf",
        GET,
        "bare-ietf-headers",
        'porch limiter, headers="ietf" (the draft\'s two fields, no X-RateLimit-*)',
    ),
    Case("limiter-power", "limiter-power", GET, "bare-headers", "porch limiter, durability=power"),
    Case(
        "limiter-concurrency",
        "limiter-concurrency",
        GET,
        "limiter",
        "porch limiter with a concurrency cap too (a slot taken and freed per request)",
    ),
    Case("slowapi-memory", "slowapi-memory", GET, "bare", "slowapi, in-memory storage"),
    Case(
        "slowapi-redis",
        "slowapi-redis",
        GET,
        "bare",
        "slowapi, Redis storage (appendfsync everysec)",
        redis="everysec",
    ),
    Case(
        "slowapi-redis-fsync",
        "slowapi-redis",
        GET,
        "bare",
        "slowapi, Redis with appendfsync always",
        redis="always",
    ),
    Case(
        "limiter-redis",
        "limiter-redis",
        GET,
        "bare-headers",
        "porch limiter, Redis store (appendfsync everysec)",
        redis="everysec",
    ),
    Case(
        "limiter-cluster",
        "limiter-cluster",
        GET,
        "bare-headers",
        "porch limiter on a Redis Cluster (3 primaries, 3 replicas, no AOF; loopback)",
        servers="redis-cluster",
    ),
    Case(
        "limiter-concurrency-redis",
        "limiter-concurrency-redis",
        GET,
        "limiter-redis",
        "porch limiter with a concurrency cap, Redis store (appendfsync everysec)",
        redis="everysec",
    ),
    Case(
        "limiter-redis-fsync",
        "limiter-redis",
        GET,
        "bare-headers",
        "porch limiter, Redis store with appendfsync always",
        redis="always",
    ),
    Case("bare-post", "bare", POST, "bare-post", "POST /orders, no idempotency", "/orders"),
    Case(
        "idem-first",
        "idempotency",
        POST_NEW_KEY,
        "bare-post",
        "porch idempotency, a new key per request",
        "/orders",
    ),
    Case(
        "idem-first-frozen",
        "idempotency",
        POST_NEW_KEY,
        "bare-post",
        "porch idempotency, a new key per request, the app calls gc.freeze() at start-up",
        "/orders",
        env=FROZEN,
    ),
    Case(
        "idem-replay",
        "idempotency",
        POST_SAME_KEY,
        "bare-post",
        "porch idempotency, one key (replays)",
        "/orders",
    ),
    Case(
        "idem-first-redis",
        "idempotency-redis",
        POST_NEW_KEY,
        "bare-post",
        "porch idempotency, Redis store (everysec), a new key per request",
        "/orders",
        redis="everysec",
    ),
    Case(
        "idem-first-redis-fsync",
        "idempotency-redis",
        POST_NEW_KEY,
        "bare-post",
        "porch idempotency, Redis store (always), a new key per request",
        "/orders",
        redis="always",
    ),
    Case(
        "idem-replay-redis",
        "idempotency-redis",
        POST_SAME_KEY,
        "bare-post",
        "porch idempotency, Redis store (everysec), one key (replays)",
        "/orders",
        redis="everysec",
    ),
    Case(
        "idem-replay-redis-fsync",
        "idempotency-redis",
        POST_SAME_KEY,
        "bare-post",
        "porch idempotency, Redis store (always), one key (replays)",
        "/orders",
        redis="always",
    ),
    Case(
        "peer-idem-first",
        "peer-idempotency",
        POST_NEW_KEY,
        "bare-post",
        "asgi-idempotency-header (memory), a new key per request",
        "/orders",
    ),
    Case(
        "peer-idem-replay",
        "peer-idempotency",
        POST_SAME_KEY,
        "bare-post",
        "asgi-idempotency-header (memory), one key",
        "/orders",
    ),
    Case(
        "limiter-postgres",
        "limiter-postgres",
        GET,
        "bare-headers",
        "porch limiter on PostgreSQL (loopback, synchronous_commit on)",
        postgres=True,
    ),
    Case(
        "limiter-sharded-postgres",
        "limiter-sharded",
        GET,
        "bare-headers",
        "porch limiter on two PostgreSQL servers (a sharded store: each key at one home)",
        servers="postgres-2",
    ),
    Case(
        "limiter-concurrency-postgres",
        "limiter-concurrency-postgres",
        GET,
        "limiter-postgres",
        "porch limiter with a concurrency cap on PostgreSQL (loopback, synchronous_commit on)",
        postgres=True,
    ),
    Case(
        "idem-first-postgres",
        "idempotency-postgres",
        POST_NEW_KEY,
        "bare-post",
        "porch idempotency on PostgreSQL, a new key per request",
        "/orders",
        postgres=True,
    ),
    Case(
        "idem-replay-postgres",
        "idempotency-postgres",
        POST_SAME_KEY,
        "bare-post",
        "porch idempotency on PostgreSQL, one key (replays)",
        "/orders",
        postgres=True,
    ),
    # A realistic handler: it awaits ~2 ms of I/O (asyncio.sleep, standing in for a
    # database query) before it answers, so the ratio is the one a user with a real
    # app sees. Each is compared with the bare app running the same handler.
    Case("bare-io", "bare", GET, "bare-io", "bare, GET / awaiting ~2 ms of I/O", env=IO),
    Case("limiter-io", "limiter", GET, "bare-io", "porch limiter, handler awaiting ~2 ms", env=IO),
    Case(
        "bare-post-io",
        "bare",
        POST,
        "bare-post-io",
        "POST /orders awaiting ~2 ms of I/O, no idempotency",
        "/orders",
        env=IO,
    ),
    Case(
        "idem-first-io",
        "idempotency",
        POST_NEW_KEY,
        "bare-post-io",
        "porch idempotency, a new key per request, handler awaiting ~2 ms",
        "/orders",
        env=IO,
    ),
    Case(
        "idem-replay-io",
        "idempotency",
        POST_SAME_KEY,
        "bare-post-io",
        "porch idempotency, one key (replays: the handler does not run)",
        "/orders",
        env=IO,
    ),
    Case("bare-2w", "bare", GET, "bare-2w", "bare, 2 workers", workers=2),
    Case("limiter-2w", "limiter", GET, "bare-2w", "porch limiter, 2 workers", workers=2),
    Case("bare-4w", "bare", GET, "bare-4w", "bare, 4 workers", workers=4),
    Case(
        "bare-headers-4w",
        "bare-headers",
        GET,
        "bare-4w",
        "bare app sending the limiter's five headers itself, 4 workers",
        workers=4,
    ),
    Case("limiter-4w", "limiter", GET, "bare-headers-4w", "porch limiter, 4 workers", workers=4),
)

# The policies (docs/policies/): each on every store, against the fixed-window limiter on
# that store in the same round.
_POLICIES = (
    ("sliding", "a sliding window"),
    ("gcra", "a gcra bucket"),
    ("levels", "three levels (the caller, its org, everyone): three counters per request"),
    ("settle", "a reservation settled lower by the handler (a refund with every request)"),
)
_STORES = (("", "SQLite"), ("-postgres", "PostgreSQL"), ("-redis", "Redis (everysec)"))
CASES += tuple(
    Case(
        f"limiter-ietf{suffix}",
        f"limiter-ietf{suffix}",
        GET,
        "bare-ietf-headers",
        f'porch limiter, headers="ietf", {store}',
        redis="everysec" if suffix == "-redis" else "",
        postgres=suffix == "-postgres",
    )
    for suffix, store in _STORES[1:]
) + tuple(
    Case(
        f"limiter-{policy}{suffix}",
        f"limiter-{policy}{suffix}",
        GET,
        f"limiter{suffix}",
        f"porch limiter, {what}, {store}",
        redis="everysec" if suffix == "-redis" else "",
        postgres=suffix == "-postgres",
    )
    for suffix, store in _STORES
    for policy, what in _POLICIES
)
