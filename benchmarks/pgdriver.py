"""The PostgreSQL driver, side by side for porch's workload: asyncpg against psycopg 3.

    python benchmarks/pgdriver.py [--seconds 3] [--rounds 3] [--in-flight 4]

porch's PostgreSQL store sends each batch as ONE call of a server-side function
(``hits_v2`` for the limiter: eleven array arguments, a few rows back) in
autocommit, with a few batches in flight per process. So what a driver costs
porch is the event loop's CPU per call (the app's core is the bottleneck; the
server runs on the other) and the calls per second it sustains. This runs that
call against a throwaway PostgreSQL (production durability, as bench.py) on
the real schema, from one uvloop loop pinned to CPU 0, ``--in-flight``
connections each keeping one call out, for two batch shapes: one hot client (one
key, 16 alike hits) and 16 distinct clients. Drivers are interleaved round by
round. psycopg runs in async mode with server-side prepared statements
(``prepare=True``), as asyncpg prepares and caches every statement, in text
and (``psycopg-bin``) in binary format, asyncpg's only one; psycopg's
pipeline mode would not change one statement per round trip. Prints a table;
writes nothing. Needs ``pip install -e '.[bench]'`` (psycopg is in that extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

import porch
from _stores import Postgres

Call = Callable[[], Awaitable[Any]]

# hits_v2's arguments (store/postgres/hits.py): keys, then per limit its key, amount and
# window (tags, bursts, deltas and stamps NULL: fixed windows), per hit its first limit and
# multiplicity (costs NULL: one unit); the prune bound; no test clock.
_HOT = (
    ["rl\x1fr\x1f1000000000-per-60s\x1f10.0.0.1"],
    [1], [10**9], [60.0], None, None, None, None, [1], [16], None, 64, None,
)  # fmt: skip
_SPREAD = (
    [f"rl\x1fr\x1f1000000000-per-60s\x1f10.0.1.{i}" for i in range(16)],
    list(range(1, 17)),
    [10**9] * 16,
    [60.0] * 16,
    None, None, None, None,
    list(range(1, 17)),
    [1] * 16,
    None,
    64,
    None,
)  # fmt: skip
SHAPES = {"hot client": _HOT, "16 clients": _SPREAD}


async def asyncpg_calls(url: str, n: int, args: tuple[Any, ...]) -> tuple[list[Call], Call]:
    import asyncpg

    conns = [await asyncpg.connect(url) for _ in range(n)]
    sql = "SELECT * FROM porch.hits_v2(" + ", ".join(f"${n}" for n in range(1, 14)) + ")"

    def call(conn: Any) -> Call:
        return lambda: conn.fetch(sql, *args)

    async def close() -> None:
        for conn in conns:
            await conn.close()

    return [call(c) for c in conns], close


async def psycopg_calls(
    url: str, n: int, args: tuple[Any, ...], *, binary: bool = False
) -> tuple[list[Call], Call]:
    import psycopg

    conns = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(n)]
    sql = (
        "SELECT * FROM porch.hits_v2(%s::text[], %s::int[], %s::bigint[], %s::float8[],"
        " %s::int[], %s::bigint[], %s::bigint[], %s::float8[], %s::int[], %s::int[],"
        " %s::bigint[], %s::int, %s::float8)"
    )

    def call(conn: Any) -> Call:
        async def one() -> Any:
            cur = await conn.execute(sql, args, prepare=True, binary=binary)
            return await cur.fetchall()

        return one

    async def close() -> None:
        for conn in conns:
            await conn.close()

    return [call(c) for c in conns], close


async def psycopg_binary_calls(url: str, n: int, args: tuple[Any, ...]) -> tuple[list[Call], Call]:
    return await psycopg_calls(url, n, args, binary=True)


DRIVERS = {"asyncpg": asyncpg_calls, "psycopg": psycopg_calls, "psycopg-bin": psycopg_binary_calls}


async def measure(driver: str, url: str, n: int, shape: str, seconds: float) -> tuple[float, float]:
    """(calls per second, event-loop CPU µs per call) over ``seconds``."""
    calls, close = await DRIVERS[driver](url, n, SHAPES[shape])
    try:
        for call in calls:  # connected, prepared, warm
            for _ in range(20):
                await call()
        done = 0
        stop = time.monotonic() + seconds

        async def run(call: Call) -> None:
            nonlocal done
            while time.monotonic() < stop:
                await call()
                done += 1

        cpu, wall = time.thread_time(), time.monotonic()
        await asyncio.gather(*(run(c) for c in calls))
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
        return done / wall, cpu / done * 1e6
    finally:
        await close()


async def setup(url: str) -> None:
    store = porch.open_store(url)  # the real schema and functions
    await store.open()
    await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=4)
    opts = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})  # as the app server; PostgreSQL runs on CPU 1
    pg = Postgres()
    try:
        uvloop.run(setup(pg.url))
        found: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(opts.rounds):
            for shape in SHAPES:
                for driver in DRIVERS:
                    got = uvloop.run(measure(driver, pg.url, opts.in_flight, shape, opts.seconds))
                    found.setdefault((shape, driver), []).append(got)
                    print(f"round {r + 1} {shape:10} {driver:11} {got[0]:8.0f} calls/s"
                          f" {got[1]:6.1f} µs loop CPU/call", flush=True)  # fmt: skip
        print(f"\nmedians, {opts.rounds} interleaved rounds, {opts.in_flight} calls in flight:")
        print("| batch | driver | calls/s | loop CPU µs/call |\n|---|---|---:|---:|")
        for (shape, driver), runs in found.items():
            rate = statistics.median(x[0] for x in runs)
            cpu = statistics.median(x[1] for x in runs)
            print(f"| {shape} | {driver} | {rate:,.0f} | {cpu:.1f} |")
    finally:
        pg.stop()


if __name__ == "__main__":
    main()
