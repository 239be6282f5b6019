"""The SQLite store's footprint (issue 12): owner-only files, expired responses reclaimed
without new saves, space given back, and big saves never holding up small batches."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from porch.clock import ManualClock
from porch.store.base import Hit, Lookup, Save, StoredResponse, StoreOp
from porch.store.sqlite import SQLiteStore
from porch.store.sqlite.schema import migrate
from porch.store.sqlite.upkeep import (
    CHECKPOINT_PACE,
    FREE_PAGES,
    WAL_LIMIT,
    Checkpoints,
    FairBatches,
    join_within,
)
from support import spin, until, used

pytestmark = pytest.mark.anyio

MIB = 1 << 20


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=1000.0, wall=1_700_000_000.0, boot_id="boot-a")


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def modes(directory: Path) -> dict[str, int]:
    return {path.name: mode(path) for path in directory.iterdir()}


def response(size: int) -> StoredResponse:
    return StoredResponse(b"d" * 32, 201, ((b"content-type", b"text/plain"),), b"x" * size)


def file_pages(path: Path) -> tuple[int, int]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
    return int(pages), int(free)


def count_responses(path: Path) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        (n,) = conn.execute("SELECT COUNT(*) FROM responses").fetchone()
    return int(n)


@pytest.mark.usefixtures("loose_umask")
async def test_store_files_and_directory_are_owner_only(tmp_path: Path) -> None:
    data = tmp_path / "new" / "data"
    store = SQLiteStore(data)
    await store.open()
    try:
        # A claim creates the lock file; a save makes sure the WAL and its index exist.
        await store.apply([Save("s\x1fk", response(10), 60.0)])
        await store.apply([Hit(["k"], [1], [60.0])])
        files = sorted(p.name for p in data.iterdir())
        assert {"porch.sqlite3", "porch.sqlite3-wal", "porch.sqlite3-shm"} <= set(files)
        for path in data.iterdir():
            assert mode(path) == 0o600, (path.name, oct(mode(path)))
        assert mode(data) == 0o700
    finally:
        await store.close()


@pytest.mark.usefixtures("loose_umask")
async def test_existing_world_readable_files_are_tightened(tmp_path: Path) -> None:
    db = tmp_path / "porch.sqlite3"
    conn = sqlite3.connect(db, isolation_level=None)
    migrate(conn)
    conn.close()
    os.chmod(db, 0o644)
    os.chmod(tmp_path, 0o755)
    store = SQLiteStore(tmp_path)
    await store.open()
    await store.apply([Hit(["k"], [1], [60.0])])
    await store.close()
    assert mode(db) == 0o600
    assert mode(tmp_path) == 0o755  # a directory porch did not create is the operator's


@pytest.mark.usefixtures("loose_umask")
async def test_every_existing_porch_file_is_tightened(tmp_path: Path) -> None:
    # Catches: the lock file (and the side file's) found 0644 and never tightened (issue
    # 26, finding 6): only the data file and its -wal/-shm were.
    from porch.store.base import Claim

    store = SQLiteStore(tmp_path)
    await store.open()
    claim = Claim("s\x1fk")
    await store.apply([claim, Save("s\x1fbig", response(200 * 1024), 60.0)])
    await store.close()
    names = set(modes(tmp_path))
    assert {"porch.sqlite3", "porch.sqlite3.locks", "porch-blobs.sqlite3"} <= names
    for name in names:
        os.chmod(tmp_path / name, 0o644)  # as an earlier porch, or a careless copy, left them
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        again = Claim("s\x1fk2")
        await store.apply([again, Save("s\x1fbig2", response(200 * 1024), 60.0)])
        assert again.token > 0
        assert set(modes(tmp_path).values()) == {0o600}, modes(tmp_path)
    finally:
        await store.close()


async def test_an_existing_file_is_switched_to_incremental_vacuum(tmp_path: Path) -> None:
    db = tmp_path / "porch.sqlite3"
    conn = sqlite3.connect(db, isolation_level=None)
    migrate(conn)  # a file as an earlier porch made it: auto_vacuum off
    (before,) = conn.execute("PRAGMA auto_vacuum").fetchone()
    conn.close()
    assert before == 0
    store = SQLiteStore(tmp_path)
    await store.open()
    await store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (2,)
    conn.close()


async def test_expired_responses_are_reclaimed_without_new_saves(
    tmp_path: Path, clock: ManualClock
) -> None:
    store = SQLiteStore(tmp_path, clock=clock, upkeep_after=0.05)
    await store.open()
    try:
        for i in range(4):
            await store.apply([Save(f"s\x1f{i}-{j}", response(64 * 1024), 10.0) for j in range(25)])
        full_pages, _ = file_pages(store.path)
        assert count_responses(store.path) == 100
        clock.advance(11)
        # Nothing is saved or looked up: the idle writer prunes and gives the pages back.
        for _ in range(200):
            if count_responses(store.path) == 0 and file_pages(store.path)[1] == 0:
                break
            await asyncio.sleep(0.05)
        pages, free = file_pages(store.path)
        assert count_responses(store.path) == 0
        assert pages < full_pages // 4, (pages, full_pages)
        assert free == 0
    finally:
        await store.close()


async def test_lookups_alone_prune_expired_responses(tmp_path: Path, clock: ManualClock) -> None:
    # upkeep_after is long: only the transactions of lookups and hits can prune here.
    store = SQLiteStore(tmp_path, clock=clock, upkeep_after=3600)
    await store.open()
    try:
        await store.apply([Save(f"s\x1f{i}", response(1000), 10.0) for i in range(50)])
        clock.advance(11)
        await store.apply([Lookup("s\x1fother")])
        await store.apply([Hit(["k"], [1], [60.0])])
        assert count_responses(store.path) == 0
    finally:
        await store.close()


async def test_a_store_never_idle_gives_pages_back_between_decisions(
    tmp_path: Path, clock: ManualClock
) -> None:
    # upkeep_after is long: only the busy writer's own give-back (on every few
    # transactions, while more than FREE_PAGES are free) can shrink the file here.
    store = SQLiteStore(tmp_path, clock=clock, upkeep_after=3600)
    await store.open()
    try:
        for i in range(4):
            await store.apply([Save(f"s\x1f{i}-{j}", response(64 * 1024), 10.0) for j in range(25)])
        clock.advance(11)
        await store.apply([Hit(["k"], [10**6], [60.0])])
        await store.apply([Hit(["k"], [10**6], [60.0])])
        assert count_responses(store.path) == 0
        full_pages, free = file_pages(store.path)
        assert free > FREE_PAGES
        for _ in range(200):
            await store.apply([Hit(["k"], [10**6], [60.0])])
        pages, free = file_pages(store.path)
        assert free <= FREE_PAGES
        assert pages < full_pages
    finally:
        await store.close()


async def test_big_saves_never_hold_up_a_small_batch(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        done: list[str] = []

        async def apply(name: str, ops: list[Hit | Save]) -> None:
            await store.apply(ops)
            done.append(name)

        # Another process holds the write lock while twenty batches of two 60 KiB saves
        # (bodies kept in the data file: bigger ones go to the side file) and then a
        # decision queue up: once it lets go, the decision goes in the next
        # transaction, not after 2.4 megabytes.
        blocker = sqlite3.connect(store.path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            big = [
                asyncio.create_task(
                    apply(
                        f"big{i}",
                        [Save(f"s\x1f{i}.{j}", response(60 << 10), 60.0) for j in range(2)],
                    )
                )
                for i in range(20)
            ]
            await spin()  # each hands its batch to the writer's queue in its first step
            # The writer took the first of them (and waits for the lock with them).
            await until(lambda: store._writer.queued() < len(big), "the writer took a batch")
            small = asyncio.create_task(apply("hit", [Hit(["k"], [5], [60.0])]))
            # Queued within a few loop turns (at once, or by the inline flush that finds
            # the file busy), before the lock is let go.
            await spin()
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        await asyncio.gather(small, *big)
        # Only the transaction already waiting for the lock (1 MiB: 8 batches) went first.
        assert done.index("hit") <= 8, done
        # The saves took several transactions (1 MiB per group commit).
        assert store.statistics().transactions >= 3
        assert count_responses(store.path) == 40
    finally:
        await store.close()


@pytest.mark.parametrize("thread", ["running", "held"])
async def test_checkpoints_keep_the_wal_bounded_while_the_writer_never_idles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: str
) -> None:
    # Catches: checkpoints turned off on the writer with nothing else copying the WAL back
    # (it would hold every frame written: ~22 MiB here, 11x its limit), or a WAL that
    # never restarts; counts lost by checkpoints running beside the writer. "held": the
    # checkpoint thread never gets to a round (as when a loaded machine keeps it from
    # running), and the writer's backstop alone bounds the WAL. The limit is
    # cut to 2 MiB so that about a second of writes passes it many times over (the
    # checkpoint thread and the writer's journal_size_limit read it at open), and the
    # pace by as much: the WAL stays near its limit only while the writer adds less than
    # that per pace (16 MiB per 0.25 s with the real values; this writer adds ~20 MiB/s).
    limit = 2 * MIB
    monkeypatch.setattr("porch.store.sqlite.upkeep.WAL_LIMIT", limit)
    monkeypatch.setattr("porch.store.sqlite.writer.WAL_LIMIT", limit)
    pace = CHECKPOINT_PACE * limit / WAL_LIMIT
    monkeypatch.setattr("porch.store.sqlite.upkeep.CHECKPOINT_PACE", pace)
    released = threading.Event()
    if thread == "held":
        rounds = Checkpoints._run

        def held_run(self: Checkpoints, conn: sqlite3.Connection) -> None:
            released.wait(60.0)
            rounds(self, conn)

        monkeypatch.setattr(Checkpoints, "_run", held_run)
    store = SQLiteStore(tmp_path)
    await store.open()
    wal = store.path.with_name(store.path.name + "-wal")
    peak = 0
    written = last = 0  # frames: a lower bound of those the WAL took in (not those
    # added between a client's last look and a restart)

    async def client(n: int) -> None:  # eight at once: the writer always has a batch
        nonlocal peak, written, last
        for batch in range(n, 1000, 8):
            await store.apply(
                [
                    Hit([f"rl\x1fr\x1f9-per-60s\x1f10.{batch % 256}.{batch // 256}.{i}"], [9], [60])
                    for i in range(100)
                ]
            )
            peak = max(peak, wal.stat().st_size)
            frames = wal_frames(store.path)
            written += frames - last if frames >= last else frames  # restarted meanwhile
            last = frames

    try:
        await asyncio.gather(*(client(n) for n in range(8)))  # 100,000 new clients
        hits = [Hit(["rl\x1fr\x1f9-per-60s\x1f10.5.0.7"], [9], [60])]
        await store.apply(hits)
        assert used(hits[0]) == [2]
    finally:
        released.set()
        await store.close()
    assert written * 4096 > 5 * limit, f"only {written * 4096 / MIB:.1f} MiB written"
    assert peak < 3 * limit, (
        f"WAL grew to {peak / MIB:.1f} MiB ({written * 4096 / MIB:.1f} written)"
    )
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("SELECT count(*) FROM counts").fetchone()[0] == 100_000


def test_fair_batches_hold_big_saves_while_asked_and_small_ones_still_go() -> None:
    small: list[StoreOp] = [Hit(["k"], [1], [60.0])]
    big: list[StoreOp] = [Save("s\x1fk", StoredResponse(b"d" * 32, 201, (), b"x" * MIB), 60.0)]
    fair: FairBatches[list[StoreOp]] = FairBatches(lambda job: job)
    assert fair.next_transaction([big, small], hold_big=True) == [small]
    assert fair  # the big one waits
    assert fair.next_transaction([small], hold_big=True) == [small]
    assert fair.next_transaction([small]) == [small, big]
    assert not fair


def test_a_wal_catch_up_holds_big_saves_until_the_checkpoint_thread_copied_them(
    tmp_path: Path,
) -> None:
    # Catches: the writer copying, on the commit path, every page big saves wrote during
    # the last background round (a decision waited up to 170 ms); a hold never released.
    path = tmp_path / "wal.sqlite3"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("PRAGMA journal_mode = WAL")
    writer.execute("CREATE TABLE t (b BLOB)")
    failures: list[sqlite3.Error] = []
    checkpoints = Checkpoints(
        lambda: sqlite3.connect(path, isolation_level=None, check_same_thread=False),
        failures.append,
    )
    checkpoints.start(writer, "test-checkpoint")

    def commits_until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10.0
        while not condition():
            assert time.monotonic() < deadline, "condition never held"
            writer.execute("INSERT INTO t VALUES (x'00')")  # a decision's small commit
            checkpoints.committed(writer)
            time.sleep(0.001)

    try:
        # Past the limit, short of the writer's own backstop (BACKSTOP limits).
        writer.execute("INSERT INTO t VALUES (zeroblob(?))", (3 * WAL_LIMIT // 2,))
        checkpoints.committed(writer)
        commits_until(lambda: checkpoints.holding)  # the WAL is past its limit: hold
        commits_until(lambda: not checkpoints.holding)  # one more round copied it: go
        writer.execute("INSERT INTO t VALUES (x'00')")
        with sqlite3.connect(path) as other:  # the WAL restarted from its start
            _, frames, _ = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert frames < 16
    finally:
        checkpoints.stop()
        writer.close()
    assert failures == []


def wal_frames(path: Path) -> int:
    """Frames in the WAL now: ``mxFrame`` of the wal-index header in ``<file>-shm``
    (https://www.sqlite.org/walformat.html), read without touching the database."""
    with open(path.with_name(path.name + "-shm"), "rb") as shm:
        return int.from_bytes(shm.read(20)[16:20], "little")


async def test_the_wal_restarts_while_every_commit_runs_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a WAL that only the writer's idle upkeep (every upkeep_after seconds, a
    # minute here) catches up while decisions commit on the event loop one at a time,
    # growing without bound meanwhile, with the checkpoint thread copying back to back.
    # The limit is cut to 2 MiB (512 one-page commits) and the pace by as much, as above:
    # the bound is counted in frames, whatever the machine's speed (with 16 MiB, the 8,000
    # commits of two restarts outlasted a 10 s deadline beside two busy loops).
    limit = 2 * MIB
    monkeypatch.setattr("porch.store.sqlite.upkeep.WAL_LIMIT", limit)
    monkeypatch.setattr("porch.store.sqlite.writer.WAL_LIMIT", limit)
    pace = CHECKPOINT_PACE * limit / WAL_LIMIT
    monkeypatch.setattr("porch.store.sqlite.upkeep.CHECKPOINT_PACE", pace)
    bound = 8 * (limit // 4096)
    store = SQLiteStore(tmp_path, upkeep_after=60.0)
    apply_now = store.capabilities.apply_now  # what the pool calls for a lone hit
    assert apply_now is not None
    await store.open()
    restarts, peak, last = 0, 0, 0
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120.0  # a hang, not a slow machine: the bound is in frames
        while restarts < 2:
            assert loop.time() < deadline, f"{restarts} WAL restarts, peak {peak} frames"
            hits: list[StoreOp] = [Hit(["rl\x1fr\x1f9-per-60s\x1f10.0.0.1"], [10**9], [60])]
            if not apply_now(hits):
                await store.apply(hits)  # the writer's turn (a catch-up under way)
            await asyncio.sleep(0)
            frames = wal_frames(store.path)
            restarts += frames < last
            peak, last = max(peak, frames), frames
            assert peak < bound, f"the WAL grew to {peak} frames after {restarts} restarts"
    finally:
        await store.close()


def test_closing_never_waits_for_a_thread_that_does_not_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Catches: a close that joins the store's threads (writer, side file, checkpoints)
    # without a deadline, hanging on one that is stuck (issue 24: no hang, ever).
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="porch-stuck", daemon=True)
    stuck.start()
    try:
        started = time.monotonic()
        join_within(stuck, 0.2)
        assert time.monotonic() - started < 10.0  # 0.2 s; a loaded machine is late
        assert stuck.is_alive()
        assert "thread porch-stuck did not stop within 0.2 s; left to finish" in caplog.text
    finally:
        release.set()
        stuck.join(10.0)
