"""The Quart extension (porch.integrations.quart), in process with Quart's test app.

Served by a real server: tests/e2e/test_examples.py runs examples/quart_app.py under uvicorn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from quart import Quart

from porch import ConfigurationError, IdempotencyRule, Rule
from porch.integrations.quart import Porch

pytestmark = pytest.mark.anyio


def make_app(tmp_path: Path, **config: Any) -> tuple[Quart, list[int]]:
    app = Quart(__name__, instance_path=str(tmp_path / "instance"))
    orders: list[int] = []

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    @app.post("/orders")
    async def order() -> tuple[dict[str, int], int]:
        orders.append(1)
        return {"order": len(orders)}, 201

    settings: dict[str, Any] = {
        "PORCH_DATA_DIR": str(tmp_path / "data"),
        "PORCH_RULES": Rule("2/minute", path="/hello"),
        "PORCH_IDEMPOTENCY": [IdempotencyRule("/orders")],
    }
    app.config.update({**settings, **config})
    Porch(app)
    return app, orders


async def test_the_pool_opens_and_closes_with_serving(tmp_path: Path) -> None:
    app, orders = make_app(tmp_path)
    pool = Porch.state(app).pool
    assert pool is not None
    async with app.test_app() as serving:
        assert pool.started  # before_serving, on this loop
        c = serving.test_client()
        assert [(await c.get("/hello")).status_code for _ in range(3)] == [200, 200, 429]
        # Quart's test client sends no client address: the caller is named by credentials.
        key = {"Idempotency-Key": "o1", "Authorization": "Bearer alice"}
        first, again = await c.post("/orders", headers=key), await c.post("/orders", headers=key)
        assert await again.get_data() == await first.get_data()
        assert again.headers["Idempotent-Replayed"] == "true"
    assert not pool.started
    assert orders == [1]
    assert not (tmp_path / "data" / "porch.sqlite3-wal").exists()


async def test_switched_off_by_config(tmp_path: Path) -> None:
    app, _ = make_app(tmp_path, PORCH_ENABLED=False)
    async with app.test_app() as serving:
        c = serving.test_client()
        assert [(await c.get("/hello")).status_code for _ in range(3)] == [200] * 3
    assert Porch.state(app).pool is None
    assert not (tmp_path / "data").exists()


async def test_a_wrong_setting_fails_init_app(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="PORCH_IDEMPOTENCY must be a IdempotencyRule"):
        make_app(tmp_path, PORCH_IDEMPOTENCY="/orders")
