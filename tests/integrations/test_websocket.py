"""WebSocket handshakes limited before accept: a real uvicorn server and a real client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from porch import KeyPool, RateLimitMiddleware, Rule, SQLiteStore
from porch._types import Message
from porch.integrations.starlette import install, limit
from servers import free_port
from support import sqlite_counters as counters

uvicorn = pytest.importorskip("uvicorn")
ws_client = pytest.importorskip("websockets.asyncio.client")
ws_exceptions = pytest.importorskip("websockets.exceptions")

pytestmark = pytest.mark.anyio


async def echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text(await websocket.receive_text())
    await websocket.close()


def make_app(pool: KeyPool) -> Any:
    chat = limit("2/minute")(echo)
    app = Starlette(routes=[WebSocketRoute("/chat", chat), WebSocketRoute("/feed", echo)])
    install(app, pool, manage_pool=False)
    # An app-level rule that opted in for handshakes, beside the route limit.
    return RateLimitMiddleware(app, pool=pool, rules=Rule("1/minute", path="/feed", websocket=True))


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    port = free_port()
    config = uvicorn.Config(
        make_app(pool), host="127.0.0.1", port=port, lifespan="off", log_level="warning"
    )
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    for _ in range(200):
        if srv.started:
            break
        await asyncio.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    try:
        yield f"ws://127.0.0.1:{port}", tmp_path
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 30)
        await pool.close()


async def test_a_limited_handshake_is_refused_before_accept(server: tuple[str, Path]) -> None:
    base, data = server
    for i in range(2):
        async with ws_client.connect(base + "/chat", open_timeout=30) as ws:
            assert ws.response.headers["x-ratelimit-remaining"] == str(1 - i)
            await ws.send("hi")
            assert await ws.recv() == "hi"
    with pytest.raises(ws_exceptions.InvalidStatus) as info:
        async with ws_client.connect(base + "/chat", open_timeout=30):
            pass
    response = info.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == "60"
    assert response.headers["content-type"] == "application/problem+json"

    async with ws_client.connect(base + "/feed", open_timeout=30) as ws:
        await ws.send("x")
        assert await ws.recv() == "x"
    with pytest.raises(ws_exceptions.InvalidStatus) as info:
        async with ws_client.connect(base + "/feed", open_timeout=30):
            pass
    assert info.value.response.status_code == 429
    assert counters(data) == {
        "rl\x1froute:WS:/chat\x1f2-per-60s\x1f127.0.0.1": 2,
        "rl\x1f/feed\x1f1-per-60s\x1f127.0.0.1": 1,
    }


async def handshake(app: Any) -> Message:
    """Drive one handshake without the denial extension; the first message the app sends."""
    sent: list[Message] = []
    scope = {
        "type": "websocket",
        "path": "/chat",
        "raw_path": b"/chat",
        "root_path": "",
        "scheme": "ws",
        "query_string": b"",
        "headers": [(b"host", b"test")],
        "client": ("10.5.5.5", 40000),
        "server": ("test", 80),
        "subprotocols": [],
        "asgi": {"version": "3.0", "spec_version": "2.3"},
    }
    inbox: list[Message] = [
        {"type": "websocket.connect"},
        {"type": "websocket.receive", "text": "a"},
    ]

    async def receive() -> Message:
        if inbox:
            return inbox.pop(0)
        return {"type": "websocket.disconnect", "code": 1000}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]


async def test_without_the_denial_extension_the_handshake_is_closed_1008(
    tmp_path: Path,
) -> None:
    pool = KeyPool(SQLiteStore(tmp_path), size=2)
    app = make_app(pool)
    try:
        first = [await handshake(app) for _ in range(3)]
        assert [m["type"] for m in first] == ["websocket.accept"] * 2 + ["websocket.close"]
        assert first[2]["code"] == 1008
    finally:
        await pool.close()
