"""A network store reached from another host without TLS is said once (issue 26, finding
11), against real servers: one on loopback (nothing said) and one listening on this host's
non-loopback address, reached as another host would reach it."""

from __future__ import annotations

import logging
import uuid

import pytest

from porch.store.transport import check_transport, is_local
from servers import local_address, running_postgres, running_redis

pytestmark = pytest.mark.anyio


def transport_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "porch.store" and r.levelno == logging.WARNING and "TLS" in r.getMessage()
    ]


@pytest.mark.parametrize(
    ("host", "local"),
    [
        (None, True),
        ("/run/postgresql", True),
        ("127.0.0.1", True),
        ("127.3.0.9", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("192.0.2.7", False),
        ("2001:db8::7", False),
        ("db.internal", False),
    ],
)
def test_what_counts_as_this_host(host: str | None, local: bool) -> None:
    assert is_local(host) is local


def test_the_message_says_what_is_wrong_and_hides_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "porch.store")
    url = "redis://:pw-123@db.internal/0?password=pw-123"

    def check(peer: str, *, tls: bool, verified: bool) -> str:
        return check_transport("Redis", url, peer, tls=tls, verified=verified, setting="x") or ""

    assert check("127.0.0.1", tls=False, verified=False) == ""
    assert check("db.internal", tls=True, verified=True) == ""
    plain = check("db.internal", tls=False, verified=False)
    unchecked = check("10.0.0.5", tls=True, verified=False)
    assert "without TLS" in plain
    assert "without a certificate check" in unchecked
    assert "pw-123" not in plain + unchecked
    assert len(transport_warnings(caplog)) == 2


def non_loopback() -> str:
    address = local_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    return address


@pytest.mark.redis
async def test_a_redis_store_on_another_host_without_tls_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("redis")
    from porch.store.base import Hit
    from porch.store.redis import RedisStore

    caplog.set_level(logging.WARNING, "porch.store")
    address = non_loopback()
    # A password, so that Redis's protected mode accepts a connection from outside.
    with running_redis(password="pw-tls", also_on=address) as server:
        prefix = f"porch-tls-{uuid.uuid4().hex[:8]}"
        near = RedisStore(f"redis://:pw-tls@127.0.0.1:{server.port}/0", prefix=prefix)
        await near.open()
        await near.close()
        assert transport_warnings(caplog) == []
        far = RedisStore(f"redis://:pw-tls@{address}:{server.port}/0", prefix=prefix)
        for _ in range(2):  # opened again (a pool moving to a new loop): said once
            await far.open()
            hit = Hit(["k"], [5], [60.0])
            await far.apply([hit])
            assert hit.allowed
            await far.close()
    [warning] = transport_warnings(caplog)
    assert f"at {address} without TLS" in warning
    assert "pw-tls" not in warning
    assert "rediss://" in warning


@pytest.mark.postgres
async def test_a_postgres_store_on_another_host_without_tls_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("asyncpg")
    from porch.store.postgres import PostgresStore

    caplog.set_level(logging.WARNING, "porch.store")
    address = non_loopback()
    with running_postgres(also_on=address) as server:
        near = PostgresStore(server.url, schema="porch_near")
        await near.open()
        await near.close()
        assert transport_warnings(caplog) == []
        far = PostgresStore(
            server.url.replace("127.0.0.1", address) + "?sslmode=prefer", schema="porch_far"
        )
        for _ in range(2):
            await far.open()
            await far.close()
    [warning] = transport_warnings(caplog)
    assert f"at {address} without TLS" in warning
    assert "sslmode=verify-full" in warning
