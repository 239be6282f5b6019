"""Secrets stay secret (issue 26): no password form of a store URL is ever printed, by
the operator CLI or the demo, against real Redis and PostgreSQL servers; no scope porch
shows or stores can be tested against a dictionary of passwords."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo_server import DemoLauncher, launch_demos, porch_cli

from servers import running_redis

pytestmark = [pytest.mark.e2e]

SECRET = "Pw-9d1e7c"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def shown(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


@pytest.mark.redis
def test_a_redis_password_is_never_printed(demo: DemoLauncher) -> None:
    # Catches: ?password= printed by porch inspect / check and the demo's startup line
    # (issue 26, finding 3; only user:pw@ was redacted).
    pytest.importorskip("redis")
    with running_redis(password=SECRET) as redis_server:
        base = f"redis://127.0.0.1:{redis_server.port}/0"
        forms = [
            f"{base}?password={SECRET}",
            f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0",
            f"{base}?pass%77ord={SECRET}",
        ]
        server = demo.start(limit=10, window=60, store=forms[0])
        assert SECRET not in server.output()
        assert f"{base}?password=***" in server.output()  # the startup line, redacted
        for url in forms:
            # The password is really used: the commands succeed against requirepass.
            for argv in (("inspect", "--store", url), ("inspect", "--json", "--store", url)):
                done = porch_cli(*argv)
                assert done.returncode == 0, shown(done).replace(SECRET, "<SECRET>")
                assert SECRET not in shown(done)
            done = porch_cli("check", "--store", url)
            assert SECRET not in shown(done)
        wrong = porch_cli("inspect", "--store", f"{base}?password=wrong-{SECRET}")
        assert wrong.returncode == 2
        assert SECRET not in shown(wrong)
        server.terminate()


@pytest.mark.postgres
def test_a_postgres_password_is_never_printed(postgres_url: str) -> None:
    pytest.importorskip("asyncpg")
    # The test cluster trusts loopback: the password is accepted and ignored.
    url = f"{postgres_url}?password={SECRET}"
    for argv in (("inspect", "--store", url), ("check", "--store", url)):
        done = porch_cli(*argv)
        assert "postgresql://" in shown(done)  # the location is printed, redacted
        assert SECRET not in shown(done)
    broken = porch_cli("inspect", "--store", f"{postgres_url}?password={SECRET}&sslmode=bogus")
    assert broken.returncode == 2
    assert SECRET not in shown(broken)


def unkeyed_scope(authorization: bytes) -> str:
    """What CallerScope showed before the fix: "cred:" + an unkeyed digest of the header."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"a %d:" % len(authorization))
    h.update(authorization)
    return "cred:" + h.hexdigest()


def test_a_basic_auth_password_is_not_recovered_from_porch_inspect(demo: DemoLauncher) -> None:
    # Catches: porch inspect showed "cred:" + an unkeyed digest of Authorization, and a
    # Basic-auth password was recovered from it with a three-word dictionary (finding 4).
    server = demo.start(limit=10, window=60)
    authorization = b"Basic " + base64.b64encode(b"alice:hunter2")
    with server.client(timeout=30.0) as http:
        created = http.post(
            "/orders",
            json={"item": "tea", "qty": 1},
            headers={"Idempotency-Key": "k-1", "Authorization": authorization.decode()},
        )
    assert created.status_code == 201
    done = porch_cli("inspect", "--json", "--data-dir", str(server.data_dir))
    assert done.returncode == 0, done.stderr
    [response] = json.loads(done.stdout)["responses"]
    scope = response["scope"]
    assert scope.startswith("cred:")
    for word in ("password", "letmein", "hunter2"):
        guess = b"Basic " + base64.b64encode(f"alice:{word}".encode())
        assert scope != unkeyed_scope(guess), f"recovered: {word}"
