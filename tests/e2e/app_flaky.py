"""A tiny ASGI app with failing handlers behind porch's IdempotencyMiddleware, for the gate.

The demo has no route that fails, so the idempotency gate starts this app as a
real uvicorn server process::

    PORCH_FLAKY_DATA=/tmp/x python -m uvicorn app_flaky:create_app --factory \
        --app-dir tests/e2e --host 127.0.0.1 --port P

Every handler execution is recorded as a row in ``<data>/executions.sqlite3``
(table ``executions``) *before* the handler decides its outcome, so the test
counts executions from rows, never from logs. Porch's own store lives in
``<data>/porch.sqlite3``, or at the store URL in ``PORCH_FLAKY_STORE`` (several
hosts sharing one store, and one data directory: their executions are counted
together).

Routes (every POST is keyed: rule ``/``, method POST, key optional); the JSON
body is ``{"tag": str}`` and ``?latency=SECONDS`` sleeps inside the handler so
duplicates overlap (``?block=SECONDS`` on ``/ok``: the handler blocks the event
loop instead, as synchronous work in an ``async def`` does):

- ``POST /flaky``: 500 on the first execution for a tag, 201 afterwards.
- ``POST /always-fails``: always 500.
- ``POST /raises``: always raises (Starlette's error middleware answers 500).
- ``POST /ok``: always 201; ``?pad=N`` (at most 1 MiB) adds N bytes to the response.
- ``GET /health``: 200 (not keyed).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from porch import IdempotencyMiddleware, IdempotencyRule, KeyPool, SQLiteStore, open_store

DATA_ENV = "PORCH_FLAKY_DATA"
STORE_ENV = "PORCH_FLAKY_STORE"
EXECUTIONS_FILE = "executions.sqlite3"
MAX_LATENCY = 10.0
MAX_PAD = 1 << 20


class HandlerFailure(RuntimeError):
    """What ``POST /raises`` raises."""


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    return conn


def _record(path: Path, route: str, tag: str) -> int:
    """Record one execution of ``route`` for ``tag``; return how many there are now (1-based)."""
    with closing(_connect(path)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO executions (route, tag) VALUES (?, ?)", (route, tag))
        (count,) = conn.execute(
            "SELECT COUNT(*) FROM executions WHERE route = ? AND tag = ?", (route, tag)
        ).fetchone()
        conn.execute("COMMIT")
    return int(count)


async def _tag(request: Request) -> str:
    payload = json.loads(await request.body())
    tag = payload["tag"] if isinstance(payload, dict) else None
    if not isinstance(tag, str) or not tag:
        raise ValueError("body must be {'tag': non-empty string}")
    return tag


async def _latency(request: Request) -> None:
    latency = float(request.query_params.get("latency", "0"))
    if latency > 0:
        await asyncio.sleep(min(latency, MAX_LATENCY))


def _block(request: Request) -> None:
    block = float(request.query_params.get("block", "0"))
    if block > 0:
        time.sleep(min(block, MAX_LATENCY))  # the event loop runs nothing meanwhile


def create_app() -> Starlette:
    """The uvicorn factory: data directory from ``PORCH_FLAKY_DATA``."""
    data = Path(os.environ[DATA_ENV])
    data.mkdir(parents=True, exist_ok=True)
    executions = data / EXECUTIONS_FILE
    with closing(_connect(executions)) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS executions (id INTEGER PRIMARY KEY AUTOINCREMENT,"
            " route TEXT NOT NULL, tag TEXT NOT NULL)"
        )

    async def record(request: Request, route: str) -> tuple[str, int]:
        tag = await _tag(request)
        # One short synchronous write on the loop: the count is decided atomically.
        return tag, _record(executions, route, tag)

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def flaky(request: Request) -> JSONResponse:
        tag, execution = await record(request, "flaky")
        await _latency(request)
        if execution == 1:
            return JSONResponse(
                {"tag": tag, "execution": execution, "error": "first attempt fails"},
                status_code=500,
            )
        return JSONResponse({"tag": tag, "execution": execution}, status_code=201)

    async def always_fails(request: Request) -> JSONResponse:
        tag, execution = await record(request, "always-fails")
        await _latency(request)
        return JSONResponse(
            {"tag": tag, "execution": execution, "error": "always fails"}, status_code=500
        )

    async def raises(request: Request) -> JSONResponse:
        tag, execution = await record(request, "raises")
        await _latency(request)
        raise HandlerFailure(f"handler for {tag!r} failed on execution {execution}")

    async def ok(request: Request) -> JSONResponse:
        tag, execution = await record(request, "ok")
        await _latency(request)
        _block(request)
        pad = min(int(request.query_params.get("pad", "0")), MAX_PAD)
        document: dict[str, object] = {"tag": tag, "execution": execution}
        if pad > 0:
            document["pad"] = "x" * pad
        return JSONResponse(document, status_code=201)

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/flaky", flaky, methods=["POST"]),
            Route("/always-fails", always_fails, methods=["POST"]),
            Route("/raises", raises, methods=["POST"]),
            Route("/ok", ok, methods=["POST"]),
        ]
    )
    url = os.environ.get(STORE_ENV)
    pool = KeyPool(open_store(url) if url else SQLiteStore(data), size=4, mailbox=1024)
    app.add_middleware(
        IdempotencyMiddleware, pool=pool, rules=IdempotencyRule("/", methods=["POST"])
    )
    return app
