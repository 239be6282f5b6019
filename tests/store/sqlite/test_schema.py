"""The SQLite file's schema: migration 4 (compact counter rows) upgrades a version 3 file
in place, and the operator's view of the counters is unchanged by it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from porch.clock import ManualClock
from porch.store.base import Hit
from porch.store.sqlite import SQLiteStore
from porch.store.sqlite import schema as sqlite_schema
from porch.store.sqlite.counters import split_key
from support import used

pytestmark = pytest.mark.anyio

US = "\x1f"
ALICE = f"rl{US}default{US}5-per-60s{US}10.0.0.1"
ALICE_AUTH = f"rl{US}auth{US}3-per-60s{US}10.0.0.1"
BOB = f"rl{US}default{US}5-per-60s{US}10.0.0.2"
ODD = f"rl{US}default{US}5-per-60s{US}user{US}with{US}separators"  # US inside the client
PLAIN = "k"  # not porch's format (the store seam takes any key)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=1000.0, wall=1_700_000_000.0, boot_id="boot-a")


def version_3_file(path: Path, clock: ManualClock, counts: dict[str, int]) -> None:
    """A file as porch's third schema version left it, with these counters live."""
    conn = sqlite3.connect(path, isolation_level=None)
    for number in range(3):
        for statement in sqlite_schema.statements(sqlite_schema._MIGRATIONS[number]):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 3")
    conn.execute("INSERT INTO porch_meta VALUES ('boot_id', ?)", (clock.boot_id(),))
    now = clock.monotonic()
    for key, count in counts.items():
        conn.execute(
            "INSERT INTO counters VALUES (?, ?, ?, ?, ?)", (key, count, now, now + 60, clock.wall())
        )
    conn.execute(
        "INSERT INTO responses (key, digest, status, headers, body, stored_at, expires,"
        " stored_wall, scope, size) VALUES ('s\x1fk', x'00', 201, '[]', x'61', ?, ?, ?, 's', 10)",
        (now, now + 60, clock.wall()),
    )
    conn.close()


def full_rows(path: Path) -> dict[str, tuple[int, float]]:
    with sqlite3.connect(path) as conn:
        return {k: (c, e) for k, c, e in conn.execute("SELECT key, count, expires FROM counters")}


def test_split_key_takes_three_fields_as_the_name() -> None:
    assert split_key(ALICE) == (f"rl{US}default{US}5-per-60s{US}", "10.0.0.1")
    assert split_key(ODD) == (f"rl{US}default{US}5-per-60s{US}", f"user{US}with{US}separators")
    assert split_key(PLAIN) == ("", PLAIN)
    assert split_key(f"a{US}b") == ("", f"a{US}b")
    assert split_key(f"a{US}b{US}c{US}") == (f"a{US}b{US}c{US}", "")


async def test_a_version_3_file_is_upgraded_in_place_and_keeps_every_counter(
    tmp_path: Path, clock: ManualClock
) -> None:
    # Catches: counters lost or miscounted by the move to (name, client) rows, a key split
    # differently by the migration's SQL than by the writer (the migrated row would be a
    # stranger: the hit would start a fresh window), the responses touched.
    path = tmp_path / "porch.sqlite3"
    live = {ALICE: 5, ALICE_AUTH: 1, BOB: 2, ODD: 4, PLAIN: 3}
    version_3_file(path, clock, live)
    before = full_rows(path)
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        assert full_rows(path) == before  # the view shows every key as it was
        hits = [Hit([key], [5], [60.0]) for key in live]
        await store.apply(hits)
        assert [(h.allowed, used(h)[0]) for h in hits] == [
            (False, 5),  # alice at her limit stays refused
            (True, 2),
            (True, 3),
            (True, 5),
            (True, 4),
        ]
        assert all(0 < h.next[0] <= 60 for h in hits)  # the old windows, not fresh ones
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == sqlite_schema.SCHEMA_VERSION
        kinds = dict(conn.execute("SELECT name, type FROM sqlite_master"))
        assert kinds["counters"] == "view"
        assert kinds["counts"] == "table"
        assert "counters_expires" not in kinds
        assert conn.execute("SELECT count(*) FROM counts").fetchone()[0] == len(live)
        # One name per rule and limit; the plain key's name is empty.
        names = sorted(p for (p,) in conn.execute("SELECT prefix FROM counter_names"))
        assert names == ["", f"rl{US}auth{US}3-per-60s{US}", f"rl{US}default{US}5-per-60s{US}"]
        assert conn.execute("SELECT key, size FROM responses").fetchall() == [("s\x1fk", 10)]
        assert conn.execute("SELECT bytes FROM response_total").fetchone()[0] == 10
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert {k: c for k, (c, _) in full_rows(path).items()} == {
        ALICE: 5,
        ALICE_AUTH: 2,
        BOB: 3,
        ODD: 5,
        PLAIN: 4,
    }


async def test_new_counters_of_one_rule_share_one_name(tmp_path: Path, clock: ManualClock) -> None:
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        await store.apply(
            [Hit([f"rl{US}r{US}1-per-9s{US}10.0.0.{i}"], [9], [9.0]) for i in range(50)]
        )
        await store.apply(
            [Hit([f"rl{US}r{US}1-per-9s{US}10.0.1.{i}"], [9], [9.0]) for i in range(5)]
        )
    finally:
        await store.close()
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("SELECT prefix FROM counter_names").fetchall() == [
            (f"rl{US}r{US}1-per-9s{US}",)
        ]
        assert conn.execute("SELECT count(*) FROM counts").fetchone()[0] == 55


async def test_counters_view_rows_can_be_deleted(tmp_path: Path, clock: ManualClock) -> None:
    # Operators (and tests) delete counters by their full key through the view.
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        await store.apply([Hit([ALICE], [5], [60.0]), Hit([BOB], [5], [60.0])])
    finally:
        await store.close()
    with sqlite3.connect(store.path) as conn:
        conn.execute("DELETE FROM counters WHERE key = ?", (ALICE,))
    assert list(full_rows(store.path)) == [BOB]


async def test_the_operator_reads_a_file_not_yet_migrated(
    tmp_path: Path, clock: ManualClock
) -> None:
    # inspect is read-only: it must show a version 3 file's counters without migrating it.
    path = tmp_path / "porch.sqlite3"
    version_3_file(path, clock, {ALICE: 2, PLAIN: 1})
    admin = SQLiteStore(tmp_path, clock=clock).admin()
    found = await admin.counters()
    assert [(c.client, c.rule, c.count) for c in found] == [("10.0.0.1", "default", 2)]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3


async def test_the_operator_finds_resets_and_purges_a_clients_counters(
    tmp_path: Path, clock: ManualClock
) -> None:
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        await store.apply([Hit([key], [5], [60.0]) for key in (ALICE, ALICE_AUTH, BOB, ODD, PLAIN)])
        await store.apply([Hit([f"rl{US}short{US}1-per-1s{US}10.0.0.9"], [5], [1.0])])
    finally:
        await store.close()
    admin = store.admin()
    assert sorted((c.rule, c.count) for c in await admin.counters(client="10.0.0.1")) == [
        ("auth", 1),
        ("default", 1),
    ]
    assert [c.client for c in await admin.counters(client=f"user{US}with{US}separators")] == [
        f"user{US}with{US}separators"
    ]
    assert len(await admin.counters()) == 5  # every porch counter; the plain key is not one
    assert await admin.reset(client="10.0.0.1", rule="nosuch") == 0
    assert await admin.reset(client="10.0.0.1", rule="auth") == 1
    assert [c.rule for c in await admin.counters(client="10.0.0.1")] == ["default"]
    assert await admin.reset(client="10.0.0.1") == 1
    assert await admin.counters(client="10.0.0.1") == []
    clock.advance(2.0)
    report = await admin.purge()
    assert (report.counters, report.responses) == (1, 0)  # the 1 s window only
    assert BOB in full_rows(store.path)


def version_4_file(path: Path, clock: ManualClock, bodies: dict[str, bytes]) -> None:
    """A file of schema version 4: responses in a WITHOUT ROWID table, with byte totals."""
    conn = sqlite3.connect(path, isolation_level=None)
    for number in range(4):
        for statement in sqlite_schema.statements(sqlite_schema._MIGRATIONS[number]):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 4")
    conn.execute("INSERT INTO porch_meta VALUES ('boot_id', ?)", (clock.boot_id(),))
    now = clock.monotonic()
    for key, body in bodies.items():
        scope = key.split(US, 1)[0]
        conn.execute(
            "INSERT INTO responses (key, digest, status, headers, body, stored_at, expires,"
            " stored_wall, scope, size) VALUES (?, x'0102', 201, '[]', ?, ?, ?, ?, ?, ?)",
            (key, body, now, now + 60, clock.wall(), scope, len(key) + 2 + 2 + len(body)),
        )
    conn.close()


async def test_a_version_4_file_keeps_its_responses_and_byte_totals(
    tmp_path: Path, clock: ManualClock
) -> None:
    # Catches: responses or their byte totals lost or doubled by the move to a rowid
    # table (the copy must fire no trigger), triggers missing on the new table.
    from porch.store.base import Lookup, Save, StoredResponse

    path = tmp_path / "porch.sqlite3"
    bodies = {f"a{US}k1": b"x" * 5000, f"a{US}k2": b"y" * 70_000, f"b{US}k": b""}
    version_4_file(path, clock, bodies)
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        lookups = [Lookup(key) for key in bodies]
        await store.apply(lookups)
        assert [op.result.body if op.result else None for op in lookups] == list(bodies.values())
        with sqlite3.connect(path) as conn:
            totals = dict(conn.execute("SELECT scope, bytes FROM response_bytes"))
        assert totals == {"a": (4 + 4 + 5000) + (4 + 4 + 70_000), "b": 3 + 4}
        await store.apply([Save(f"b{US}k2", StoredResponse(b"\x01\x02", 201, (), b"z" * 10), 1.0)])
        clock.advance(61.0)  # every row expires; a lookup of one prunes the rest
        await store.apply([Lookup(f"a{US}k1")])
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM responses").fetchone()[0] == 0
        assert conn.execute("SELECT bytes FROM response_total").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM response_bytes").fetchone()[0] == 0
        # A rowid table, the body its last column (see migration 5).
        columns = [row[1] for row in conn.execute("PRAGMA table_info(responses)")]
        assert columns[0] == "id"
        assert columns[-1] == "body"
    assert (await store.admin().check()).healthy


def byte_totals(path: Path) -> tuple[dict[str, object], dict[str, object]]:
    """The byte totals as the tables hold them, and as the rows of stored responses and
    reservations sum them (a figure of 0 has no row)."""
    rows = "SELECT scope, client, size FROM responses UNION ALL SELECT scope, client, size FROM"
    rows += " reservations"
    with sqlite3.connect(path) as conn:
        held = {
            "scope": dict(conn.execute("SELECT scope, bytes FROM response_bytes")),
            "client": dict(conn.execute("SELECT client, bytes FROM client_bytes")),
            "total": conn.execute("SELECT bytes FROM response_total").fetchone()[0],
        }
        summed = {
            "scope": dict(
                conn.execute(f"SELECT scope, sum(size) FROM ({rows}) GROUP BY 1 HAVING sum(size)")
            ),
            "client": dict(
                conn.execute(f"SELECT client, sum(size) FROM ({rows}) GROUP BY 1 HAVING sum(size)")
            ),
            "total": conn.execute(f"SELECT coalesce(sum(size), 0) FROM ({rows})").fetchone()[0],
        }
    return held, summed


async def test_a_version_10_file_keeps_counting_its_reservations(
    tmp_path: Path, clock: ManualClock
) -> None:
    # Catches: migration 11 (the reservations' triggers dropped, their bytes counted by the
    # writer) losing or doubling the bytes of a reservation made before it, or of one freed
    # or reclaimed after it. A dead holder's reservation of 30 bytes, counted by the
    # version 10 triggers, is freed by the next claim of its key and by a reclaim.
    from porch.store.base import Claim, Quota, Release

    path = tmp_path / "porch.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    for number in range(10):
        for statement in sqlite_schema.statements(sqlite_schema._MIGRATIONS[number]):
            conn.execute(statement, {"secret": "00" * 32} if ":secret" in statement else ())
    conn.execute("PRAGMA user_version = 10")
    conn.execute("INSERT INTO porch_meta VALUES ('boot_id', ?)", (clock.boot_id(),))
    for key in (f"a{US}dead", f"a{US}gone"):  # nobody holds their keys' locks
        conn.execute("INSERT INTO reservations VALUES (?, 'a', 'c', 30)", (key,))
    conn.close()
    assert byte_totals(path)[0] == {"scope": {"a": 60}, "client": {"c": 60}, "total": 60}
    quota = Quota(scope_bytes=10_000, total_bytes=10_000, client_bytes=200)
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        again = Claim(f"a{US}dead", scope="a", client="c", quota=quota, reserve=100)
        other = Claim(f"b{US}k", scope="b", client="d", quota=quota, reserve=50)
        await store.apply([again, other])  # the dead 30 freed, 100 and 50 reserved
        assert (again.token > 0, other.token > 0) == (True, True)
        held, summed = byte_totals(path)
        assert (
            held
            == summed
            == {"scope": {"a": 130, "b": 50}, "client": {"c": 130, "d": 50}, "total": 180}
        )
        # 130 + 80 is over the client's 200: the reclaim frees "gone"'s 30, then 180 fits.
        more = Claim(f"a{US}more", scope="a", client="c", quota=quota, reserve=80)
        await store.apply([more, Release(f"b{US}k", other.token)])
        assert more.token > 0
        held, summed = byte_totals(path)
        assert held == summed == {"scope": {"a": 180}, "client": {"c": 180}, "total": 180}
        refused = Claim(f"a{US}over", scope="a", client="c", quota=quota, reserve=100)
        await store.apply([refused])
        assert refused.over == "client"
        assert byte_totals(path)[0] == held
        await store.apply([Release(again.key, again.token), Release(more.key, more.token)])
        assert byte_totals(path) == ({"scope": {}, "client": {}, "total": 0},) * 2
    finally:
        await store.close()
    assert (await store.admin().check()).healthy
