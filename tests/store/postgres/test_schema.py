"""PostgreSQL specifics: versioned migrations, a plain role, configuration, the optional driver."""

from __future__ import annotations

import asyncio
import sys
import uuid

import asyncpg
import pytest

from porch.errors import ConfigurationError, StoreError
from porch.store.base import Claim, Hit, Quota, Save, StoredResponse
from porch.store.postgres import PostgresStore
from porch.store.postgres.schema import SCHEMA_VERSION
from support import used

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def _versions(url: str, schema: str) -> list[int]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(f'SELECT version FROM "{schema}".migrations ORDER BY version')
        return [r[0] for r in rows]
    finally:
        await conn.close()


async def test_hosts_opening_at_once_migrate_exactly_once(postgres_url: str, schema: str) -> None:
    stores = [PostgresStore(postgres_url, schema=schema) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        assert await _versions(postgres_url, schema) == list(range(1, SCHEMA_VERSION + 1))
        hits = [Hit(["k"], [100], [60.0]) for _ in stores]
        await asyncio.gather(*(s.apply([h]) for s, h in zip(stores, hits, strict=True)))
        assert sorted(used(h)[0] for h in hits) == [1, 2, 3, 4]
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    again = PostgresStore(postgres_url, schema=schema)
    await again.open()  # finds the schema current: nothing to do
    await again.close()
    assert await _versions(postgres_url, schema) == list(range(1, SCHEMA_VERSION + 1))


async def test_a_schema_from_a_newer_porch_is_refused(postgres_url: str, schema: str) -> None:
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(postgres_url)
    try:
        await conn.execute(f'INSERT INTO "{schema}".migrations (version) VALUES (999)')
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="newer than this porch understands"):
        await PostgresStore(postgres_url, schema=schema).open()


async def test_a_plain_role_that_owns_one_database_is_enough(postgres_url: str) -> None:
    tag = uuid.uuid4().hex[:10]
    role, database = f"porch_role_{tag}", f"porch_db_{tag}"
    admin = await asyncpg.connect(postgres_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
        await admin.execute(f"CREATE DATABASE {database} OWNER {role}")
        base = postgres_url.rsplit("/", 1)[0].replace("postgres@", f"{role}@")
        store = PostgresStore(f"{base}/{database}")
        await store.open()
        try:
            claim, hit = Claim("k"), Hit(["c"], [1], [60.0])
            await store.apply([claim, hit])
            assert claim.token > 0
            assert hit.allowed
        finally:
            await store.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_an_unreachable_server_fails_open_with_a_store_error() -> None:
    store = PostgresStore("postgresql://nobody@127.0.0.1:9/none", connect_timeout=1.0)
    with pytest.raises(StoreError, match="cannot connect to PostgreSQL"):
        await store.open()
    with pytest.raises(StoreError, match="not open"):
        await store.apply([Hit(["k"], [1], [1.0])])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schema": "Bad-Name"}, "schema must be a lower-case identifier of at most 48 characters"),
        ({"lease": 0.1}, "lease must be 0.3-3600 seconds, got 0.1"),
        ({"connections": 0}, "connections must be 1-64, got 0"),
        ({"connect_timeout": 0}, "connect_timeout must be 0-60 seconds, got 0"),
        ({"statement_timeout": 61}, "statement_timeout must be 0-60 seconds, got 61"),
        ({"prune_batch": 0}, "prune_batch must be >= 1, got 0"),
        ({"in_flight": 0}, "in_flight must be 1-16, got 0"),
    ],
)
def test_bad_settings_are_refused_at_construction(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        PostgresStore("postgresql://u@127.0.0.1/db", **options)  # type: ignore[arg-type]
    assert str(raised.value).startswith(message)


def test_a_url_of_another_scheme_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="url must start with postgresql://"):
        PostgresStore("mysql://u@h/db")


def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # import asyncpg now raises ImportError
    with pytest.raises(ConfigurationError) as raised:
        PostgresStore("postgresql://u@127.0.0.1/db")
    assert "pip install 'porch[postgres]'" in str(raised.value)


async def test_stored_bytes_stay_exact_over_slots_prunes_and_purge(
    postgres_url: str, schema: str
) -> None:
    # Two stores saving at once write their bytes into different usage slots;
    # the figures are sums over slots, and a purge takes them off exactly once.
    stores = [PostgresStore(postgres_url, schema=schema) for _ in range(2)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        response = StoredResponse(b"d", 201, ((b"content-type", b"text/plain"),), b"x" * 100)
        saves = [
            [Save(f"k{n}-{i}", response, 0.5, scope="s", quota=Quota()) for i in range(8)]
            for n in range(len(stores))
        ]
        await asyncio.gather(*(s.apply(ops) for s, ops in zip(stores, saves, strict=True)))
        assert {op.outcome for ops in saves for op in ops} == {"saved"}
        conn = await asyncpg.connect(postgres_url)
        try:
            size = await conn.fetchval(f'SELECT sum(size) FROM "{schema}".records')
            assert size >= 16 * 100
            used = f'SELECT coalesce(sum(bytes), 0) FROM "{schema}".usage WHERE scope = $1'
            assert await conn.fetchval(used, "s") == size
            await asyncio.sleep(1.0)  # every response expired
            report = await stores[0].admin().purge()
            assert report.responses == 16
            assert await conn.fetchval(used, "s") == 0
            total = f'SELECT sum(bytes) FROM "{schema}".usage_total'
            assert await conn.fetchval(total) == 0
        finally:
            await conn.close()
        assert (await stores[0].admin().check()).problems == ()
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_purge_recomputes_the_byte_totals_from_the_rows(
    postgres_url: str, schema: str
) -> None:
    # Hosts of an earlier porch (apply_v2) sharing the schema during an upgrade remove
    # rows without taking them off their client's total: purge puts every total right.
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    try:
        response = StoredResponse(b"d", 201, (), b"x" * 100)
        save = Save("k", response, 60.0, scope="s", client="c", quota=Quota())
        claim = Claim("r", scope="s", client="c", quota=Quota(), reserve=500)
        await store.apply([save, claim])
        assert (save.outcome, claim.token > 0) == ("saved", True)
        conn = await asyncpg.connect(postgres_url)
        try:
            s = f'"{schema}"'
            await conn.execute(f"UPDATE {s}.client_usage SET bytes = bytes + 999")
            await conn.execute(f"UPDATE {s}.usage SET bytes = bytes - 7")
            await conn.execute(f"UPDATE {s}.usage_total SET bytes = bytes + 5 WHERE slot = 3")
            assert (await store.admin().check()).problems != ()
            await store.admin().purge()
            rows = f"SELECT coalesce(sum(size), 0) FROM {s}.records WHERE client = 'c'"
            by_client = f"SELECT sum(bytes) FROM {s}.client_usage WHERE client = 'c'"
            by_scope = f"SELECT sum(bytes) FROM {s}.usage WHERE scope = 's'"
            expected = await conn.fetchval(rows)
            assert expected == save.size + 500  # the response and the live reservation
            assert await conn.fetchval(by_client) == expected
            assert await conn.fetchval(by_scope) == expected
        finally:
            await conn.close()
        assert (await store.admin().check()).problems == ()
    finally:
        await store.close()


async def test_purge_deletes_the_bodies_no_longer_kept(postgres_url: str, schema: str) -> None:
    # A body whose owner died mid-stream goes with the next upload's sweep, or now.
    store = PostgresStore(postgres_url, schema=schema, part_grace=60.0)
    await store.open()
    try:
        parts = store.capabilities.parts
        assert parts is not None
        await parts.write("k", 11, 0, b"x" * 100)
        await parts.write("k", 11, 1, b"y" * 100)
        conn = await asyncpg.connect(postgres_url)
        try:
            count = f'SELECT count(*) FROM "{schema}".parts'
            assert await conn.fetchval(count) == 2
            await store.admin().purge()
            assert await conn.fetchval(count) == 2  # within its grace: kept
            # Past its grace on the server's clock, without waiting for it: aged a minute.
            await conn.execute(f'UPDATE "{schema}".bodies SET expires = expires - 61')
            await store.admin().purge()
            assert await conn.fetchval(count) == 0
        finally:
            await conn.close()
    finally:
        await store.close()


async def test_one_batch_counts_its_own_bytes_in_order(postgres_url: str, schema: str) -> None:
    # The batch function reads each cap's figure once a batch (apply_v4's caps' view) and
    # keeps it up to date with what the batch's earlier ops took. (The conformance suite's
    # quota tests send one op a batch; the Redis Cluster, splitting a batch over slots,
    # may refuse more here: docs/stores/redis-cluster.md.)
    store = PostgresStore(postgres_url, schema=schema)
    await store.open()
    try:
        quota = Quota(scope_bytes=10_000, total_bytes=10_000, client_bytes=240)
        held = Claim("b0", scope="a", client="c", quota=quota, reserve=100)
        await store.apply([held])
        assert held.token > 0  # 100 of the client's 240, committed

        def sized(n: int) -> StoredResponse:
            return StoredResponse(b"d", 200, (), b"x" * n)

        b1 = Save("b1", sized(20), 60.0, scope="a", client="c", quota=quota)  # ~23: 123
        b2 = Claim("b2", scope="b", client="c", quota=quota, reserve=100)  # 223
        b3 = Claim("b3", scope="a", client="c", quota=quota, reserve=100)  # 323: over
        b4 = Save("b4", sized(60), 60.0, scope="a", client="c", quota=quota)  # ~63: 286, over
        b5 = Save("b5", sized(10), 60.0, scope="b", client="c", quota=quota)  # ~13: 236
        await store.apply([b1, b2, b3, b4, b5])
        outcomes = [b1.outcome, b2.token > 0, b3.over, b4.outcome, b5.outcome]
        assert outcomes == ["saved", True, "client", "quota", "saved"]
    finally:
        await store.close()
