"""In-process cost of the limiter's hot path, with metrics off and on.

    python benchmarks/hotpath.py [--requests 20000] [--rounds 5]
                                 [--algorithm fixed|sliding|gcra] [--concurrency 64]
                                 [--policy levels|settle|concurrency] [--profile]
                                 [--store sqlite|redis|postgres]
                                 [--idempotency first|replay]

Drives ``RateLimitMiddleware`` over a real SQLite pool with raw ASGI calls (no
server, no HTTP parsing), 64 concurrent requests at a time from 64 clients, and
reports CPU microseconds per request (every thread's): the best of ``--rounds`` rounds,
without metrics and with a ``PorchMetrics``. ``--algorithm`` picks the limit's
algorithm (a tree from before the policies knows only fixed windows);
``--concurrency 1`` sends one request at a time (each commits on its own);
``--clients 1`` sends every request as one client (as bench.py's wrk does).
``--policy`` takes the rule of bench.py's row of that name instead (benchmarks/apps.py:
three levels, a reservation settled lower, a concurrency cap). ``--store redis`` or
``postgres`` runs the pool over a throwaway server of that kind (as bench.py's rows): the
CPU counted is this process's, the driver's included, not the server's. ``--profile`` prints
cProfile's top functions of one more round (metrics off). ``--idempotency first`` drives
``IdempotencyMiddleware`` instead (POST /orders, a new key per request: a claim, the
handler, a save; ``replay``: one key, so every request but the first is a replay), and
reports the event loop's share of the CPU beside the total (the rest is the SQLite
writer's, or nothing on a network store). Runs
against whatever ``porch`` is importable (``PYTHONPATH=other/src`` measures
another checkout; ``--no-metrics`` for a checkout without ``porch.metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

from porch import (
    IdempotencyMiddleware,
    IdempotencyRule,
    KeyPool,
    Limit,
    RateLimitMiddleware,
    Rule,
    SQLiteStore,
    open_store,
)
from porch.store.base import Store

try:
    from _harness import BODY
    from _stores import running
    from apps import _rule, _unlimited_quota
except ImportError:  # run as benchmarks/hotpath.py from elsewhere
    from benchmarks._harness import BODY
    from benchmarks._stores import running
    from benchmarks.apps import _rule, _unlimited_quota


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if "porch.reservations" in scope:  # the settle policy: the request cost 1
        from porch.ratelimit import settle

        settle(scope, 1)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _round(
    requests: int,
    with_metrics: bool,
    algorithm: str,
    concurrency: int,
    policy: str = "",
    clients: int = 64,
    url: str = "",
) -> float:
    metrics = None
    if with_metrics:
        from porch.metrics import PorchMetrics

        metrics = PorchMetrics()
    with tempfile.TemporaryDirectory() as data:
        kwargs: dict[str, Any] = {"metrics": metrics} if metrics is not None else {}
        pool = KeyPool(_store(url, data), size=4, **kwargs)
        await pool.start()
        limit = (
            Limit(10**9, 3600) if algorithm == "fixed" else Limit(10**9, 3600, algorithm=algorithm)  # type: ignore[arg-type]
        )
        rule = _rule(f"limiter-{policy}", 3600) if policy else Rule(limit)
        app = RateLimitMiddleware(_app, pool=pool, rules=rule)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            return None

        def scope(n: int) -> dict[str, Any]:
            return {
                "type": "http",
                "method": "GET",
                "path": "/x",
                "headers": [],
                "client": (f"10.0.{n // 250}.{n % 250}", 1234),
            }

        scopes = [scope(n % clients) for n in range(concurrency)]
        started = time.process_time()  # CPU of every thread: the writer's too
        done = 0
        while done < requests:
            # A fresh scope per request, as a server gives (the middleware writes to it).
            await asyncio.gather(*(app(dict(s), receive, send) for s in scopes))
            done += len(scopes)
        elapsed = time.process_time() - started
        await pool.close()
    return elapsed / done * 1e6


_JSON = (b"content-type", b"application/json")


async def _order(scope: Any, receive: Any, send: Any) -> None:
    """bench.py's POST /orders handler: reads the body, answers 201 with its size."""
    size = 0
    more = True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    start = {"type": "http.response.start", "status": 201, "headers": [_JSON]}
    await send(start)
    await send({"type": "http.response.body", "body": b'{"id": 1, "size": %d}' % size})


async def _idempotency_round(
    requests: int, kind: str, concurrency: int, url: str
) -> tuple[float, float]:
    """CPU µs per request of the whole process and of the event loop's thread alone."""
    body = BODY.encode()
    with tempfile.TemporaryDirectory() as data:
        pool = KeyPool(_store(url, data))
        await pool.start()
        rules = IdempotencyRule("/orders", methods=["POST"])
        # bench.py's caps: none reached (wrk is one address), each claim still reserving.
        app = IdempotencyMiddleware(_order, pool=pool, rules=rules, quota=_unlimited_quota())

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] != 201:
                raise RuntimeError(f"answered {message['status']}")

        def scope(n: int) -> dict[str, Any]:
            key = f"k-{n}" if kind == "first" else "the-one-key"
            return {
                "type": "http",
                "method": "POST",
                "path": "/orders",
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"idempotency-key", key.encode()),
                ],
                "client": ("127.0.0.1", 1234),
            }

        started, loop_started = time.process_time(), time.thread_time()
        done = 0
        while done < requests:
            await asyncio.gather(*(app(scope(done + i), receive, send) for i in range(concurrency)))
            done += concurrency
        elapsed, loop = time.process_time() - started, time.thread_time() - loop_started
        await pool.close()
    return elapsed / done * 1e6, loop / done * 1e6


def _store(url: str, data: str) -> Store:
    """SQLite in ``data``, or the server at ``url`` under names of this round's own: each
    round counts from nothing, as on SQLite."""
    if not url:
        return SQLiteStore(data)
    names = f"hot{time.monotonic_ns()}"
    return open_store(
        url, **({"schema": names} if url.startswith("postgres") else {"prefix": names})
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-metrics", action="store_true")
    parser.add_argument("--algorithm", choices=["fixed", "sliding", "gcra"], default="fixed")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--policy", choices=["", "levels", "settle", "concurrency"], default="")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--clients", type=int, default=64, help="distinct clients (1: bench.py's)")
    parser.add_argument("--store", choices=["sqlite", "redis", "postgres"], default="sqlite")
    parser.add_argument("--idempotency", choices=["first", "replay"], default="")
    args = parser.parse_args()
    kinds = set() if args.store == "sqlite" else {args.store}
    with running(kinds) as servers:
        url = servers[args.store].url if kinds else ""
        if args.idempotency:
            runs = [
                asyncio.run(
                    _idempotency_round(args.requests, args.idempotency, args.concurrency, url)
                )
                for _ in range(args.rounds)
            ]
            total, loop = min(runs)
            print(
                f"{args.idempotency}: {total:.1f} us CPU/request, the event loop's {loop:.1f}"
                f" (best of {args.rounds})"
            )
            return

        def one(with_metrics: bool) -> float:
            return asyncio.run(
                _round(
                    args.requests,
                    with_metrics,
                    args.algorithm,
                    args.concurrency,
                    args.policy,
                    args.clients,
                    url,
                )
            )

        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            one(False)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            return
        cases = [False] if args.no_metrics else [False, True]
        for with_metrics in cases:
            best = min(one(with_metrics) for _ in range(args.rounds))
            label = "metrics on " if with_metrics else "metrics off"
            print(f"{label}: {best:.1f} us CPU/request (best of {args.rounds})")
    if not args.no_metrics:
        _increment_cost()


def _increment_cost() -> None:
    """What metrics add per request, measured alone: one bound counter's inc()."""
    import timeit

    from porch.metrics import PorchMetrics

    allowed, _ = PorchMetrics().ratelimit("default")
    n = 200_000
    seconds = min(timeit.repeat(allowed.inc, number=n, repeat=5))
    print(f"one counter inc(): {seconds / n * 1e6:.2f} us")


if __name__ == "__main__":
    main()
