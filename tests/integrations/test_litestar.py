"""The Litestar plugin (porch.integrations.litestar), in process with Litestar's test client.

Served by a real server: tests/e2e/test_examples.py runs examples/litestar_app.py under uvicorn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, get
from litestar.testing import AsyncTestClient

from porch import ConfigurationError, KeyPool, RateLimitMiddleware, Rule, SQLiteStore
from porch._types import ASGIApp
from porch.integrations.litestar import PorchPlugin

pytestmark = pytest.mark.anyio


@get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}


def limited(pool: KeyPool) -> Any:
    def wrap(app: ASGIApp) -> ASGIApp:
        return RateLimitMiddleware(app, pool=pool, rules=Rule("2/minute"))

    return wrap


async def test_the_plugin_opens_and_closes_the_pool_with_the_app(tmp_path: Path) -> None:
    pool = KeyPool(SQLiteStore(tmp_path))
    app = Litestar(route_handlers=[hello], plugins=[PorchPlugin(pool, wrap=limited(pool))])
    async with AsyncTestClient(app) as c:
        # Opened at startup, before any request (the app runs on the client's own loop).
        assert (tmp_path / "porch.sqlite3").exists()
        assert [(await c.get("/hello")).status_code for _ in range(3)] == [200, 200, 429]
    assert not (tmp_path / "porch.sqlite3-wal").exists()  # closed at shutdown
    assert pool.close in app.on_shutdown


async def test_switched_off_the_plugin_adds_nothing(tmp_path: Path) -> None:
    pool = KeyPool(SQLiteStore(tmp_path / "off"))
    plugin = PorchPlugin(pool, wrap=limited(pool), enabled=False)
    app = Litestar(route_handlers=[hello], plugins=[plugin])
    async with AsyncTestClient(app) as c:
        assert [(await c.get("/hello")).status_code for _ in range(3)] == [200] * 3
    assert not pool.started
    assert not (tmp_path / "off").exists()


def test_the_plugin_needs_a_pool() -> None:
    with pytest.raises(ConfigurationError, match="pool must be a porch KeyPool"):
        PorchPlugin("./porch-data")  # type: ignore[arg-type]
