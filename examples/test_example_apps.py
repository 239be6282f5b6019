"""The examples' own tests, written as an app's tests are: with porch's pytest plugin
(porch.testing), which pytest loads by itself — a throwaway store and pool, a clock the
test moves, and the helpers to reset and to assert a client is limited.

(tests/e2e/test_examples.py serves each example with a real server instead.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

import fastapi_app
import flask_app
import starlette_app
from porch import KeyPool, Store
from porch.testing import Porch

KEYED = {"Idempotency-Key": "order-1", "X-API-Key": "key-alice"}


@pytest.fixture(autouse=True)
def orders_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's orders in its own database (the apps' side effect)."""
    for module in (fastapi_app, flask_app, starlette_app):
        monkeypatch.setattr(module, "DATA", tmp_path)


@pytest.mark.parametrize("example", [fastapi_app, starlette_app], ids=["fastapi", "starlette"])
def test_hello_is_limited_and_orders_run_once(
    example: object, porch: Porch, porch_pool: KeyPool
) -> None:
    app = example.create_app(porch_pool)  # type: ignore[attr-defined]
    with TestClient(app, client=("10.1.1.1", 5000)) as client:
        for _ in range(5):
            porch.assert_not_limited(client.get("/hello"))
        porch.assert_limited(client.get("/hello"))
        porch.advance(60)  # the minute has passed
        porch.assert_not_limited(client.get("/hello"))
        assert porch.reset("10.1.1.1") == 1

        first = client.post("/orders", content=b"tea", headers=KEYED)
        again = client.post("/orders", content=b"tea", headers=KEYED)
    assert first.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"


def test_the_fastapi_app_limits_me_per_user_its_dependency_resolved(
    porch: Porch, porch_pool: KeyPool
) -> None:
    alice, bob = {"X-API-Key": "key-alice"}, {"X-API-Key": "key-bob"}
    with TestClient(fastapi_app.create_app(porch_pool), client=("10.1.1.1", 5000)) as client:
        for _ in range(3):
            porch.assert_not_limited(client.get("/me", headers=alice))
        porch.assert_limited(client.get("/me", headers=alice))
        assert client.get("/me", headers=bob).json() == {"user": "bob"}
        assert porch.counts("user:alice") == {"route:GET:/me/3-per-60s": 3}
        porch.advance(60)
        porch.assert_not_limited(client.get("/me", headers=alice))


def test_the_flask_app_with_the_test_store(porch: Porch, porch_store: Store) -> None:
    app = flask_app.create_app(PORCH_STORE=porch_store)
    try:
        client = app.test_client()
        for _ in range(5):
            porch.assert_not_limited(client.get("/hello"))
        porch.assert_limited(client.get("/hello"))
        porch.advance(60)
        porch.assert_not_limited(client.get("/hello"))
        first = client.post("/orders", data=b"tea", headers=KEYED)
        again = client.post("/orders", data=b"tea", headers=KEYED)
        assert again.data == first.data
        assert again.headers["Idempotent-Replayed"] == "true"
    finally:
        flask_app.porch.close(app)
