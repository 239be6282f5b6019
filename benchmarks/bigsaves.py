"""Do big saves stall other callers' decisions? (issue 12, finding 3)

    python benchmarks/bigsaves.py [--seconds 5] [--savers 4] [--src PATH]

Starts a real uvicorn server (one worker) whose app has porch's limiter in
front of porch's idempotency. Client A sends ``GET /ping`` (a limiter decision,
nothing saved) one after another on one connection and records each latency;
meanwhile ``--savers`` connections of client B (another loopback address, its
own process) post keyed requests whose 1 MiB responses porch stores
(``--unkeyed``: the same responses, not stored, to tell the store's share
from the cost of the responses themselves). Reports A's p50/p90/p99
alone and during the saves, and how many megabytes B got stored. ``--src``
runs another checkout's ``src`` (to compare before and after a change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def create_app() -> Any:
    """The server's app (uvicorn factory): limiter, then idempotency, then two routes."""
    from starlette.applications import Starlette
    from starlette.responses import Response
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
    from porch.store.base import Quota

    async def ping(request: Any) -> Response:
        return Response(b"pong")

    async def big(request: Any) -> Response:
        await request.body()
        return Response(b"x" * MIB, status_code=201, media_type="application/octet-stream")

    app = Starlette(routes=[Route("/ping", ping), Route("/big", big, methods=["POST"])])
    pool = KeyPool(SQLiteStore(os.environ["BIGSAVES_DATA"]), size=4, mailbox=4096)
    app.add_middleware(
        IdempotencyMiddleware,
        pool=pool,
        rules=IdempotencyRule("/big", methods=["POST"]),
        max_stored=2 * MIB,
        quota=Quota(
            scope_bytes=1 << 40,
            total_bytes=1 << 40,
            **({"client_bytes": 1 << 40} if "client_bytes" in Quota.__dataclass_fields__ else {}),
        ),
    )
    app.add_middleware(
        RateLimitMiddleware, pool=pool, rules=Rule(Limit(10**9, 3600)), exempt=("/health",)
    )
    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=100)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(q[89] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
    }


async def _pings(base: str, seconds: float) -> list[float]:
    samples: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=30.0) as a:
        await a.get("/ping")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            r = await a.get("/ping")
            samples.append(time.perf_counter() - t)
            r.raise_for_status()
    return samples


async def _saver(base: str, seconds: float, n: int, keyed: bool) -> int:
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    saved = 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=60.0, transport=transport) as b:
        i = 0
        while time.perf_counter() < end:
            i += 1
            headers = {"idempotency-key": f"s{n}-{i}"} if keyed else {}
            r = await b.post("/big", content=b"{}", headers=headers)
            saved += len(r.content) if r.status_code == 201 else 0
    return saved


async def _savers(base: str, seconds: float, savers: int, keyed: bool) -> int:
    return sum(await asyncio.gather(*(_saver(base, seconds, n, keyed) for n in range(savers))))


def _measure(base: str, seconds: float, savers: int, keyed: bool) -> dict[str, Any]:
    alone = asyncio.run(_pings(base, seconds))
    # Client B in its own process: its event loop must not delay client A's.
    saver = subprocess.Popen(
        [sys.executable, __file__, "--save", base, str(seconds + 1.0), str(savers), str(keyed)],
        stdout=subprocess.PIPE,
    )
    time.sleep(0.5)  # the saves are under way
    during = asyncio.run(_pings(base, seconds))
    out, _ = saver.communicate(timeout=120)
    return {
        "alone": _percentiles(alone),
        "during_saves": _percentiles(during),
        "mib_sent_to_savers": round(int(out) / MIB, 1),
    }


def main() -> None:
    if sys.argv[1:2] == ["--save"]:
        base, seconds, savers = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
        print(asyncio.run(_savers(base, seconds, savers, sys.argv[5] == "True")))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--savers", type=int, default=4)
    parser.add_argument("--src", default=str(ROOT / "src"))
    parser.add_argument(
        "--unkeyed", action="store_true", help="B sends no keys: the same responses, not stored"
    )
    args = parser.parse_args()
    port = _free_port()
    with tempfile.TemporaryDirectory() as data:
        env = {
            **os.environ,
            "BIGSAVES_DATA": data,
            "PYTHONPATH": os.pathsep.join([args.src, str(ROOT)]),
        }
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "benchmarks.bigsaves:create_app",
                "--factory",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            env=env,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(200):
                try:
                    httpx.get(f"{base}/ping", timeout=1.0)
                    break
                except httpx.HTTPError:
                    time.sleep(0.05)
            result = _measure(base, args.seconds, args.savers, not args.unkeyed)
        finally:
            server.terminate()
            server.wait(timeout=10)
    summary = {"src": args.src, "savers": args.savers, "stored": not args.unkeyed}
    print(json.dumps({**summary, **result}, indent=2))


if __name__ == "__main__":
    main()
