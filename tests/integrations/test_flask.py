"""The Flask extension (porch.integrations.flask): configured from app.config, in process.

The extension's server-level proof (gunicorn workers, SIGTERM) is tests/e2e/test_examples.py
serving examples/flask_app.py.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, jsonify

from porch import ConfigurationError, IdempotencyRule, Rule
from porch.integrations.flask import Porch


def make_app(tmp_path: Path, porch: Porch, **config: Any) -> tuple[Flask, list[int]]:
    app = Flask(__name__, instance_path=str(tmp_path / "instance"))
    orders: list[int] = []

    @app.get("/hello")
    def hello() -> Any:
        return jsonify(hello="world")

    @app.post("/orders")
    def order() -> Any:
        orders.append(1)
        return jsonify(order=len(orders)), 201

    settings: dict[str, Any] = {
        "PORCH_RULES": [Rule("2/minute", path="/hello")],
        "PORCH_IDEMPOTENCY": IdempotencyRule("/orders"),
    }
    app.config.update({**settings, **config})
    porch.init_app(app)
    return app, orders


def test_init_app_reads_app_config(tmp_path: Path) -> None:
    porch = Porch()
    app, orders = make_app(tmp_path, porch, PORCH_STORE=f"sqlite:///{tmp_path}/s/porch.sqlite3")
    try:
        c = app.test_client()
        assert [c.get("/hello").status_code for _ in range(3)] == [200, 200, 429]
        key = {"Idempotency-Key": "o1"}
        first, again = c.post("/orders", headers=key), c.post("/orders", headers=key)
        assert again.data == first.data
        assert again.headers["Idempotent-Replayed"] == "true"
        assert orders == [1]
    finally:
        porch.close(app)
    state = Porch.state(app)
    assert state.pool is not None
    assert not state.pool.started
    # Closed: the store's WAL is gone with its last connection.
    assert not (tmp_path / "s" / "porch.sqlite3-wal").exists()
    with contextlib.closing(sqlite3.connect(tmp_path / "s" / "porch.sqlite3")) as db:
        assert db.execute("SELECT SUM(count) FROM counters").fetchone() == (2,)


def test_one_extension_serves_several_apps_each_with_its_own_pool(tmp_path: Path) -> None:
    porch = Porch()
    one, _ = make_app(tmp_path / "one", porch)
    two, _ = make_app(tmp_path / "two", porch)
    try:
        assert Porch.state(one).pool is not Porch.state(two).pool
        assert [one.test_client().get("/hello").status_code for _ in range(3)][-1] == 429
        assert two.test_client().get("/hello").status_code == 200
        # The default store: in the app's instance folder.
        assert (tmp_path / "one" / "instance" / "porch-data" / "porch.sqlite3").exists()
    finally:
        porch.close(one)
        porch.close(two)


def test_switched_off_by_config_nothing_is_limited_or_opened(tmp_path: Path) -> None:
    app, orders = make_app(tmp_path, Porch(), PORCH_ENABLED=False)
    c = app.test_client()
    assert [c.get("/hello").status_code for _ in range(3)] == [200, 200, 200]
    c.post("/orders", headers={"Idempotency-Key": "o1"})
    c.post("/orders", headers={"Idempotency-Key": "o1"})
    assert orders == [1, 1]
    assert Porch.state(app).pool is None
    assert not (tmp_path / "instance").exists()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"PORCH_RULE": []}, "unknown porch setting 'PORCH_RULE'; porch reads PORCH_DATA_DIR,"),
        ({"PORCH_ENABLED": "no"}, "PORCH_ENABLED must be True or False, got 'no'"),
        ({"PORCH_STORE": 42}, "PORCH_STORE must be a store URL or a porch Store, got 42"),
        ({"PORCH_RULES": "5/minute"}, "PORCH_RULES must be a Rule or a list of them, got"),
        ({"PORCH_STORE": "ftp://x"}, "unknown store URL scheme 'ftp'"),
        ({"PORCH_POOL": {"sise": 2}}, "PORCH_POOL: "),
        ({"PORCH_RATELIMIT": {"exempt": ["health"]}}, "exempt paths must start with '/'"),
        ({"PORCH_IDEMPOTENCY_OPTIONS": {"ttl": 0}}, "ttl must be > 0 seconds, got 0"),
        ({"PORCH_IDEMPOTENCY_OPTIONS": {"tll": 1}}, "PORCH_IDEMPOTENCY_OPTIONS: "),
    ],
)
def test_a_wrong_setting_fails_init_app_naming_it(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        make_app(tmp_path, Porch(), **config)
    assert message in str(refused.value)


def test_installing_twice_or_reading_an_app_without_it_is_refused(tmp_path: Path) -> None:
    porch = Porch()
    app, _ = make_app(tmp_path, porch, PORCH_ENABLED=False)
    with pytest.raises(ConfigurationError, match="already installed on the Flask app"):
        porch.init_app(app)
    with pytest.raises(ConfigurationError, match="not installed on the Flask app"):
        Porch.state(Flask("bare"))
