"""Every app in examples/ served by a real server process, checked against the rows.

ASGI apps run under uvicorn; WSGI apps (Flask, Django) under gunicorn with two
sync workers, which share counts and idempotency claims only through the store.
Counts come from ``porch.sqlite3`` and the apps' ``orders.sqlite3``, never logs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from servers import free_port
from support import stop_process

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 5
STARTUP = 30.0
DELAY = 0.3  # the handler's simulated payment: duplicates overlap their owner


@dataclass(frozen=True)
class Example:
    name: str
    target: str
    server: str  # "uvicorn" or "gunicorn"
    needs: str  # the framework's module


EXAMPLES = [
    Example("starlette", "examples.starlette_app:app", "uvicorn", "starlette"),
    Example("fastapi", "examples.fastapi_app:app", "uvicorn", "fastapi"),
    Example("litestar", "examples.litestar_app:app", "uvicorn", "litestar"),
    Example("quart", "examples.quart_app:app", "uvicorn", "quart"),
    Example("django-asgi", "examples.django_app:asgi_app", "uvicorn", "django"),
    Example("django-wsgi", "examples.django_app:wsgi_app", "gunicorn", "django"),
    Example("flask", "examples.flask_app:app", "gunicorn", "flask"),
]


def command(example: Example, port: int) -> list[str]:
    if example.server == "uvicorn":
        return [
            sys.executable,
            "-m",
            "uvicorn",
            example.target,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-proxy-headers",
        ]
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers",
        "2",
        "--worker-class",
        "sync",
        "--bind",
        f"127.0.0.1:{port}",
        "--graceful-timeout",
        "10",
        example.target,
    ]


@contextlib.contextmanager
def serve(example: Example, data: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    if importlib.util.find_spec(example.needs) is None:
        pytest.skip(f"{example.needs} is not installed (pip install -e '.[examples]')")
    if example.server == "gunicorn" and importlib.util.find_spec("gunicorn") is None:
        pytest.skip("gunicorn is not installed (pip install -e '.[examples]')")
    port = free_port()
    env = {
        **os.environ,
        "PORCH_DATA": str(data),
        "HELLO_LIMIT": str(LIMIT),
        "CHECKOUT_DELAY": str(DELAY),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    log = data / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command(example, port), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            try:
                if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{example.name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield base, process
    finally:
        stop_process(process)


def rows(path: Path, sql: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return int(db.execute(sql).fetchone()[0] or 0)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example(example: Example, tmp_path: Path) -> None:
    with serve(example, tmp_path) as (base, process):
        # A burst of concurrent clients: exactly LIMIT pass, from the rows too.
        with ThreadPoolExecutor(12) as burst:
            codes = list(
                burst.map(lambda _: httpx.get(base + "/hello", timeout=30).status_code, range(12))
            )
        assert codes.count(200) == LIMIT, codes
        assert codes.count(429) == 12 - LIMIT, codes
        assert rows(tmp_path / "porch.sqlite3", "SELECT SUM(count) FROM counters") == LIMIT

        # Concurrent duplicates of one keyed order: one run, byte-identical answers.
        def order(user_key: str) -> httpx.Response:
            return httpx.post(
                base + "/orders",
                content=b"one tea",
                headers={"Idempotency-Key": "order-1", "X-API-Key": user_key},
                timeout=60,
            )

        with ThreadPoolExecutor(6) as duplicates:
            answers = list(duplicates.map(lambda _: order("key-alice"), range(6)))
        assert {a.status_code for a in answers} == {201}, [a.text for a in answers]
        assert len({a.content for a in answers}) == 1
        assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 5
        orders = tmp_path / "orders.sqlite3"
        assert rows(orders, "SELECT COUNT(*) FROM orders") == 1
        later = order("key-alice")
        assert later.content == answers[0].content
        assert later.headers["idempotent-replayed"] == "true"
        # The same key from another user is another caller's key: another order.
        bob = order("key-bob")
        assert bob.status_code == 201
        assert bob.json()["user"] == "bob"
        assert "idempotent-replayed" not in bob.headers
        assert rows(orders, "SELECT COUNT(*) FROM orders") == 2

        process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
        assert process.wait(30) in (0, -signal.SIGTERM)
    log = (tmp_path / "server.log").read_text()
    # Every process closed its store (lifespan, Litestar's plugin, Quart's extension, the
    # end of the event loop for Django without lifespan, the exit of each gunicorn worker
    # for WSGI): closing the file's last connection removes the WAL.
    assert not (tmp_path / "porch.sqlite3-wal").exists(), log[-3000:]
    assert "Task was destroyed" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_the_fastapi_example_limits_per_user_its_dependency_resolved(tmp_path: Path) -> None:
    """GET /me: a route limit keyed by the app's own user dependency (3 a minute per user),
    under uvicorn: concurrent requests of one user, exactly three pass; counted per user."""
    [example] = [e for e in EXAMPLES if e.name == "fastapi"]
    with serve(example, tmp_path) as (base, process):

        def me(api_key: str) -> httpx.Response:
            return httpx.get(base + "/me", headers={"X-API-Key": api_key}, timeout=30)

        with ThreadPoolExecutor(8) as burst:
            answers = list(burst.map(lambda _: me("key-alice"), range(8)))
        assert sorted(a.status_code for a in answers) == [200] * 3 + [429] * 5
        assert {a.json()["user"] for a in answers if a.status_code == 200} == {"alice"}
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.headers["ratelimit-policy"] == '"3-per-60s";q=3;w=60'
        assert me("key-bob").json() == {"user": "bob"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) in (0, -signal.SIGTERM)
    counted = tmp_path / "porch.sqlite3"
    assert rows(counted, "SELECT count FROM counters WHERE key LIKE '%user:alice'") == 3
    assert rows(counted, "SELECT count FROM counters WHERE key LIKE '%user:bob'") == 1
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]
