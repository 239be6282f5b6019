"""Store URLs as they are shown: no password form survives :func:`porch.store.urls.redact`."""

from __future__ import annotations

import pytest

from porch.errors import ConfigurationError
from porch.store import open_store
from porch.store.urls import redact

SECRET = "s3cr3t-Pw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cr3t-Pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u:s3cr3t-Pw@h/0", "redis://u:***@h/0"),
        ("redis://u:p@s3cr3t-Pw@h/0", "redis://u:***@h/0"),  # "@" inside the password
        ("unix://:s3cr3t-Pw@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
        ("redis://h:6379/0?password=s3cr3t-Pw", "redis://h:6379/0?password=***"),
        ("redis://h/0?db=1&PASSWORD=s3cr3t-Pw&x=1", "redis://h/0?db=1&PASSWORD=***&x=1"),
        ("rediss://h/0?pass%77ord=s3cr3t-Pw", "rediss://h/0?pass%77ord=***"),
        (
            "postgresql://u@h/db?sslmode=verify-full&sslpassword=s3cr3t-Pw",
            "postgresql://u@h/db?sslmode=verify-full&sslpassword=***",
        ),
        ("postgresql://u@h/db?password=s3cr3t-Pw", "postgresql://u@h/db?password=***"),
        ("host=h password='s3cr3t-Pw x' user=u", "host=h password=*** user=u"),
        ("host=h password = s3cr3t-Pw user=u", "host=h password = *** user=u"),
        ("sqlite:///var/lib/porch.sqlite3", "sqlite:///var/lib/porch.sqlite3"),
        ("postgresql://u@h:5432/db?sslmode=require", "postgresql://u@h:5432/db?sslmode=require"),
    ],
)
def test_every_password_form_is_redacted(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert SECRET not in redact(f"cannot open {url}: refused")


def test_a_url_in_an_open_store_error_is_redacted() -> None:
    for url in (f"nosuch://h/0?password={SECRET}", f"sqlite://h/x.sqlite3?password={SECRET}"):
        with pytest.raises(ConfigurationError) as caught:
            open_store(url)
        assert SECRET not in str(caught.value)


def test_redis_and_postgres_stores_never_show_the_password() -> None:
    pytest.importorskip("redis")
    from porch.store.redis import RedisStore

    store = RedisStore(f"redis://:{SECRET}@127.0.0.1:1/0?password={SECRET}")
    assert SECRET not in repr(store)
    assert SECRET not in store.admin().location
    pytest.importorskip("asyncpg")
    from porch.store.postgres import PostgresStore

    pg = PostgresStore(f"postgresql://u:{SECRET}@127.0.0.1:1/db?password={SECRET}")
    assert SECRET not in pg.admin().location
