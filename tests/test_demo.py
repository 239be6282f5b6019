from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from porch.cli import main
from porch.demo import DemoConfig, create_app

pytestmark = pytest.mark.anyio


async def test_storefront_routes(tmp_path: Path) -> None:
    app = create_app(DemoConfig(data_dir=str(tmp_path), limit=100))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
        assert (await c.get("/health")).json() == {"ok": True}
        products = (await c.get("/products")).json()
        assert isinstance(products, list)
        assert products
        created = await c.post("/orders", json={"item": "tea", "qty": 2})
        assert created.status_code == 201
        assert created.json() == {"id": 1, "item": "tea", "qty": 2}
        listed = (await c.get("/orders")).json()
        assert listed == {"count": 1, "orders": [{"id": 1, "item": "tea", "qty": 2}]}
        for body in (
            b"{",
            b"[1]",
            b'{"item": "", "qty": 1}',
            b'{"item": "x", "qty": 0}',
            b'{"item": "x", "qty": true}',
            b'{"item": 3, "qty": 1}',
            b"\xff",
        ):
            bad = await c.post("/orders", content=body)
            assert bad.status_code == 400, body
            assert bad.headers["content-type"] == "application/problem+json"
        assert (await c.get("/orders")).json()["count"] == 1
    await app.state.pool.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--limit", "0"], "limit amount must be an integer >= 1"),
        (["--pool-size", "0"], "pool size must be >= 1"),
        (["--mailbox", "0"], "mailbox capacity must be >= 1"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--window", "-1"], "limit window must be > 0"),
    ],
)
def test_demo_rejects_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err
