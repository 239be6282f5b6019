"""Secrets stay secret (issue 26): no password form of a store URL is ever printed, by
the operator CLI or the demo, against real Redis and PostgreSQL servers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo_server import DemoLauncher, launch_demos

from servers import running_redis

pytestmark = [pytest.mark.e2e]

SECRET = "Pw-9d1e7c"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoLauncher]:
    with launch_demos(tmp_path) as launcher:
        yield launcher


def porch_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "porch", *argv], capture_output=True, text=True, timeout=60
    )


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
