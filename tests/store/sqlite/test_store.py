from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from porch.clock import ManualClock
from porch.errors import ConfigurationError, StoreError
from porch.store.base import Algorithm, Hit
from porch.store.sqlite import SQLiteStore
from porch.store.sqlite.claims import SQLiteClaims
from porch.store.sqlite.ops import apply_batch
from porch.store.sqlite.schema import SCHEMA_VERSION, migrate
from support import used

pytestmark = pytest.mark.anyio


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=1000.0, wall=1_700_000_000.0, boot_id="boot-a")


@pytest.fixture
async def store(tmp_path: Path, clock: ManualClock) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    yield s
    await s.close()


def rows(path: Path) -> dict[str, tuple[int, float, float]]:
    with sqlite3.connect(path) as conn:
        return {
            k: (c, s, e)
            for k, c, s, e in conn.execute("SELECT key, count, window_start, expires FROM counters")
        }


async def hit(store: SQLiteStore, key: str = "k", amount: int = 3, window: float = 60) -> Hit:
    h = Hit([key], [amount], [window])
    await store.apply([h])
    return h


async def test_counts_up_to_the_limit_then_refuses_without_consuming(store: SQLiteStore) -> None:
    verdicts = [(h.allowed, used(h)[0]) for h in [await hit(store) for _ in range(5)]]
    assert verdicts == [(True, 1), (True, 2), (True, 3), (False, 3), (False, 3)]
    assert rows(store.path)["k"][0] == 3


async def test_one_batch_is_one_transaction_and_counts_each_hit(store: SQLiteStore) -> None:
    hits = [Hit(["same"], [10], [60.0]) for _ in range(15)]
    await store.apply(hits)
    assert [h.allowed for h in hits] == [True] * 10 + [False] * 5
    assert [used(h)[0] for h in hits[:10]] == list(range(1, 11))
    assert store.statistics().transactions == 1
    assert rows(store.path)["same"][0] == 10


async def test_concurrent_batches_are_group_committed(store: SQLiteStore) -> None:
    batches = [[Hit([f"k{i}"], [5], [60.0])] for i in range(200)]
    await asyncio.gather(*(store.apply(b) for b in batches))
    stats = store.statistics()
    assert stats.operations == 200
    # Batches queued while the writer was busy join one transaction.
    assert stats.transactions < 200
    assert len(rows(store.path)) == 200


async def test_all_limits_or_nothing(store: SQLiteStore) -> None:
    def two() -> Hit:
        return Hit(["second", "day"], [2, 3], [1.0, 86400.0])

    first, second, third = two(), two(), two()
    await store.apply([first, second, third])
    assert (first.allowed, second.allowed, third.allowed) == (True, True, False)
    # The refused hit consumed neither limit.
    assert used(third) == [2, 2]
    assert rows(store.path)["day"][0] == 2


async def test_elapsed_window_restarts_in_place(store: SQLiteStore, clock: ManualClock) -> None:
    for _ in range(3):
        await hit(store, window=10)
    assert not (await hit(store, window=10)).allowed
    before = rows(store.path)["k"]
    clock.advance(10.0)
    again = await hit(store, window=10)
    assert again.allowed
    assert used(again) == [1]
    after = rows(store.path)["k"]
    assert after == (1, before[1] + 10.0, before[2] + 10.0)


async def test_reset_reports_time_until_window_end(store: SQLiteStore, clock: ManualClock) -> None:
    await hit(store, window=30)
    clock.advance(12.5)
    h = await hit(store, window=30)
    assert list(h.next) == [pytest.approx(17.5)]
    assert h.wall == clock.wall()


@pytest.mark.parametrize("jump", [-7200.0, 7200.0, -86400.0 * 365])
async def test_wall_clock_jumps_grant_nothing(
    store: SQLiteStore, clock: ManualClock, jump: float
) -> None:
    for _ in range(3):
        await hit(store)
    clock.jump_wall(jump)
    assert not (await hit(store)).allowed
    clock.advance(59.0)
    assert not (await hit(store)).allowed
    clock.advance(1.0)
    assert (await hit(store)).allowed


async def test_reopen_keeps_counters(tmp_path: Path, clock: ManualClock) -> None:
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    for _ in range(3):
        await hit(s)
    await s.close()
    s2 = SQLiteStore(tmp_path, clock=clock)
    await s2.open()
    try:
        assert not (await hit(s2)).allowed
    finally:
        await s2.close()


@pytest.mark.parametrize(
    ("wall_step", "elapsed_after_boot", "allowed"),
    [
        (30.0, 0.0, False),  # 30 s of wall time passed across the reboot: 30 s left
        (60.0, 0.0, True),  # the whole window passed on the wall clock
        (-3600.0, 59.0, False),  # wall clock went backwards: counts as no time at all
        (-3600.0, 60.0, True),  # ... so the window ends a full window after the reboot
    ],
)
async def test_reboot_rebases_windows_on_wall_time_never_backwards(
    tmp_path: Path, clock: ManualClock, wall_step: float, elapsed_after_boot: float, allowed: bool
) -> None:
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    for _ in range(3):
        await hit(s)
    await s.close()
    # The machine reboots: the monotonic clock starts over near zero.
    clock.reboot("boot-b", monotonic=5.0)
    clock.jump_wall(wall_step)
    s2 = SQLiteStore(tmp_path, clock=clock)
    await s2.open()
    try:
        clock.advance(elapsed_after_boot)
        assert (await hit(s2)).allowed is allowed
    finally:
        await s2.close()


@pytest.mark.parametrize(
    ("algorithm", "wall_step", "remaining"),
    [
        # A bucket of 4 refilling one unit per 15 s, drained: 30 s later, two are back.
        ("gcra", 30.0, 2),
        ("gcra", -3600.0, 0),  # the wall clock went backwards: no time, nothing back
        # A sliding window of 4 per 60 s, full: 90 s later the full window is the previous
        # one, weighted by the half of it still overlapping: 2 of 4 are counted.
        ("sliding", 90.0, 2),
        ("sliding", -3600.0, 0),
    ],
)
async def test_reboot_rebases_buckets_and_sliding_windows_too(
    tmp_path: Path, clock: ManualClock, algorithm: Algorithm, wall_step: float, remaining: int
) -> None:
    def hit(cost: int) -> Hit:
        return Hit(["k"], [4], [60.0], [algorithm], [4], cost)

    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    drained = [hit(1) for _ in range(4)]
    await s.apply(drained)
    assert [h.allowed for h in drained] == [True] * 4
    await s.close()
    clock.reboot("boot-b", monotonic=5.0)
    clock.jump_wall(wall_step)
    s2 = SQLiteStore(tmp_path, clock=clock)
    await s2.open()
    try:
        look = hit(0)  # a hit of no units: what is left, changing nothing
        await s2.apply([look])
        assert list(look.remaining) == [remaining]
    finally:
        await s2.close()


async def test_incremental_prune_is_bounded(tmp_path: Path, clock: ManualClock) -> None:
    s = SQLiteStore(tmp_path, clock=clock, prune_batch=10)
    await s.open()
    try:
        await s.apply([Hit([f"old{i}"], [1], [5.0]) for i in range(35)])
        clock.advance(6.0)
        await hit(s, "fresh")
        # One new row: the prune may delete max(10, 2 * 1) expired rows.
        assert len(rows(s.path)) == 35 - 10 + 1
        await hit(s, "fresh")
        await hit(s, "fresh")
        assert len(rows(s.path)) == 35 - 30 + 1
    finally:
        await s.close()


async def test_churn_keeps_the_table_bounded(tmp_path: Path, clock: ManualClock) -> None:
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    try:
        for round_ in range(40):
            await s.apply([Hit([f"c{round_}-{i}"], [1], [1.0]) for i in range(50)])
            clock.advance(1.0)
        # Clients that never return: at most about two rounds of rows stay.
        assert len(rows(s.path)) <= 100
    finally:
        await s.close()


async def test_schema_version_is_recorded_and_a_newer_file_is_refused(
    tmp_path: Path, clock: ManualClock
) -> None:
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    await s.close()
    with sqlite3.connect(s.path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    s2 = SQLiteStore(tmp_path, clock=clock)
    with pytest.raises(StoreError, match="newer than this porch"):
        await s2.open()


async def test_unopenable_file_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "porch.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot open SQLite store"):
        await SQLiteStore(tmp_path).open()


async def test_locked_database_fails_closed_after_busy_timeout(tmp_path: Path) -> None:
    s = SQLiteStore(tmp_path, busy_timeout=0.2)
    await s.open()
    blocker = sqlite3.connect(s.path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match="locked"):
            await s.apply([Hit(["k"], [1], [60.0])])
        assert s.statistics().failures == 1
        blocker.execute("ROLLBACK")
        ok = Hit(["k"], [1], [60.0])
        await s.apply([ok])
        assert ok.allowed
    finally:
        blocker.close()
        await s.close()


async def test_power_durability_syncs_fully(tmp_path: Path) -> None:
    s = SQLiteStore(tmp_path, durability="power")
    await s.open()
    try:
        assert (await hit(s)).allowed
    finally:
        await s.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"durability": "sometimes"}, "durability must be 'process' or 'power'"),
        ({"busy_timeout": -1}, "busy_timeout must be >= 0"),
        ({"prune_batch": 0}, "prune_batch must be >= 1"),
        ({"filename": "a/b"}, "filename must be a bare file name"),
    ],
)
def test_bad_settings_are_configuration_errors(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        SQLiteStore(tmp_path, **kwargs)  # type: ignore[arg-type]


async def test_apply_before_open_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not open"):
        await SQLiteStore(tmp_path).apply([Hit(["k"], [1], [1.0])])


def test_many_processes_opening_a_new_file_all_succeed(tmp_path: Path) -> None:
    # Worker processes start together on an empty data directory: creating the
    # file and switching it to WAL must not fail any of them with "locked".
    script = (
        "import asyncio, sys, time\n"
        "from porch.store.sqlite import SQLiteStore\n"
        "from porch.store.base import Hit\n"
        "async def main():\n"
        "    s = SQLiteStore(sys.argv[1])\n"
        "    while time.time() < float(sys.argv[2]): pass\n"
        "    await s.open()\n"
        "    await s.apply([Hit(['k'], [100], [60.0])])\n"
        "    await s.close()\n"
        "asyncio.run(main())\n"
    )
    start = str(time.time() + 1.5)  # every process starts opening at the same instant
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path), start], stderr=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    errors = [p.communicate(timeout=30)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errors
    assert rows(tmp_path / "porch.sqlite3")["k"][0] == 6


async def test_a_version_1_file_is_migrated_and_keeps_its_counters(
    tmp_path: Path, clock: ManualClock
) -> None:
    # A file written by the first release (counters only): upgrading adds the
    # responses table and keeps every counter.
    from porch.store.sqlite import schema as sqlite_schema

    path = tmp_path / "porch.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in sqlite_schema._MIGRATIONS[0].split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(
        "INSERT INTO counters VALUES ('k', 3, ?, ?, ?)",
        (clock.monotonic(), clock.monotonic() + 60, clock.wall()),
    )
    conn.execute("INSERT INTO porch_meta VALUES ('boot_id', ?)", (clock.boot_id(),))
    conn.close()
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    try:
        assert not (await hit(s)).allowed  # the stored count (3 of 3) survived
    finally:
        await s.close()
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert check.execute("SELECT count(*) FROM responses").fetchone()[0] == 0


async def test_a_version_2_file_gets_scopes_sizes_and_totals(
    tmp_path: Path, clock: ManualClock
) -> None:
    # A file of the second release: stored responses without scope or size.
    # Upgrading derives each row's scope from its key and counts its bytes.
    from porch.store.base import Claim
    from porch.store.sqlite import schema as sqlite_schema

    path = tmp_path / "porch.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    for number in (0, 1):
        for statement in sqlite_schema.statements(sqlite_schema._MIGRATIONS[number]):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO porch_meta VALUES ('boot_id', ?)", (clock.boot_id(),))
    now = clock.monotonic()
    for key, body in (("alice\x1fk1", b"x" * 100), ("alice\x1fk2", b"y" * 50), ("bob\x1fk", b"")):
        conn.execute(
            "INSERT INTO responses VALUES (?, ?, 201, '[]', ?, ?, ?, ?)",
            (key, b"d" * 32, body, now, now + 60, clock.wall()),
        )
    conn.close()
    s = SQLiteStore(tmp_path, clock=clock)
    await s.open()
    try:
        claim = Claim("alice\x1fk1")
        await s.apply([claim])
        assert claim.stored is not None
        assert claim.stored.body == b"x" * 100
    finally:
        await s.close()
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        scopes = dict(check.execute("SELECT key, scope FROM responses"))
        assert scopes == {"alice\x1fk1": "alice", "alice\x1fk2": "alice", "bob\x1fk": "bob"}
        per_scope = dict(check.execute("SELECT scope, bytes FROM response_bytes"))
        # key + digest + headers ('[]') + body, in bytes
        assert per_scope == {"alice": (8 + 32 + 2 + 100) + (8 + 32 + 2 + 50), "bob": 5 + 32 + 2}
        total = check.execute("SELECT bytes FROM response_total").fetchone()[0]
        assert total == sum(per_scope.values())


@pytest.mark.parametrize(
    "headers",
    [
        (),
        ((b"content-type", b"application/json"),),
        ((b"location", b"/a?b=1&c=[2]"), (b"etag", b"W/x")),
        ((b"etag", b'"quoted"'),),
        ((b"x", b"back\\slash"),),
        ((b"x", b"caf\xe9"),),
        ((b"x", b"tab\there"),),
        ((b"x", b"\x7f"),),
        ((b"x", b""),),
    ],
)
def test_stored_headers_are_exactly_their_json(headers: tuple[tuple[bytes, bytes], ...]) -> None:
    # Sizes count these bytes against quotas, and rows stored before read the same way.
    import json

    from porch.store.sqlite.saves import headers_json

    recent: dict[tuple[tuple[bytes, bytes], ...], str] = {}
    stored = headers_json(headers, recent)
    assert stored == headers_json(headers)  # the same without a recent-heads dict
    assert stored == json.dumps([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers])
    assert [(k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(stored)] == list(
        headers
    )
    # Again, from the recent heads (an equal head, not the same object), and a bytearray
    # value (no dict key) encoded the same.
    assert headers_json(tuple((bytes(k), bytes(v)) for k, v in headers), recent) == stored
    assert headers_json(tuple((k, bytearray(v)) for k, v in headers), recent) == stored  # type: ignore[misc]


def test_recent_heads_stay_bounded_and_exact() -> None:
    import json

    from porch.store.sqlite import saves

    recent: saves.Heads = {}
    for i in range(3 * saves.HEADS_MAX):
        head = ((b"location", f"/orders/{i}".encode()), (b"content-type", b"text/plain"))
        expected = json.dumps([["location", f"/orders/{i}"], ["content-type", "text/plain"]])
        assert saves.headers_json(head, recent) == expected
        assert saves.headers_json(head, recent) == expected  # as kept
        assert len(recent) <= saves.HEADS_MAX


def pruning_steps(path: Path, live: int, batch: int) -> int:
    """SQLite VM steps (in hundreds) of a transaction of ``batch`` new hits that prunes the
    10 expired counters among ``live`` live ones of the same limit."""
    prefix = "rl\x1f/\x1f10/60\x1f"
    claims = SQLiteClaims(path.with_name(path.name + ".locks"))
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        migrate(conn)
        old = [Hit([f"{prefix}old{i}"], [10], [5.0]) for i in range(10)]
        apply_batch(conn, old, 0.0, 0.0, 1, claims)
        fresh = [Hit([f"{prefix}live{i}"], [10], [60.0]) for i in range(live)]
        apply_batch(conn, fresh, 1.0, 1.0, 1, claims)
        steps = 0

        def step() -> int:
            nonlocal steps
            steps += 1
            return 0

        conn.set_progress_handler(step, 100)
        new = [Hit([f"{prefix}new{i}"], [10], [60.0]) for i in range(batch)]
        apply_batch(conn, new, 10.0, 10.0, 10, claims)
        conn.set_progress_handler(None, 0)
        (left,) = conn.execute("SELECT count(*) FROM counts WHERE expires <= 10.0").fetchone()
        assert left == 0  # all 10 pruned
        return steps
    finally:
        conn.close()


@pytest.mark.parametrize("batch", [1, 2], ids=["lone-hit", "batch"])
def test_pruning_expired_counters_reads_only_them(tmp_path: Path, batch: int) -> None:
    # One hit takes apply_batch's lone-hit path, two the batch path; both prune. SQLite
    # planned the former one-statement prune (DELETE ... WHERE (name, client) IN
    # (SELECT ...)) as a search on the limit's name alone: every transaction after the
    # first windows expired read every live row of that limit (all its clients).
    few = pruning_steps(tmp_path / "few.sqlite3", 1_000, batch)
    many = pruning_steps(tmp_path / "many.sqlite3", 20_000, batch)
    assert many <= few + 2, (few, many)
