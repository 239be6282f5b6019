"""Bodies above 64 KiB in the side file, written by a thread of its own (issue 12): a big
save never occupies the decision writer; body first, row second."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from porch.clock import ManualClock
from porch.store.base import Claim, Hit, Lookup, Parts, Quota, Save, StoredResponse
from porch.store.sqlite import SQLiteStore
from porch.store.sqlite.blobs import ORPHAN_GRACE, blob_path
from support import until, used, wait_until

pytestmark = pytest.mark.anyio

MIB = 1 << 20
KEY = "s\x1fkey"
DEADLINE = 10.0  # bounds every wait; none of them decides an order


def response(size: int, fill: bytes = b"x") -> StoredResponse:
    return StoredResponse(b"d" * 32, 201, ((b"content-type", b"text/plain"),), fill * size)


def blobs(path: Path) -> int:
    with sqlite3.connect(blob_path(path)) as conn:
        return int(conn.execute("SELECT count(*) FROM blobs").fetchone()[0])


def named(path: Path) -> list[tuple[str, int | None, int]]:
    with sqlite3.connect(path) as conn:
        return list(conn.execute("SELECT key, blob, length(body) FROM responses ORDER BY key"))


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


async def test_a_decision_is_answered_while_a_big_save_is_held_in_the_side_file(
    tmp_path: Path,
) -> None:
    # Catches: the body written by the decision writer (a decision waited behind it).
    store = SQLiteStore(tmp_path)
    await store.open()
    holder = sqlite3.connect(blob_path(store.path), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # the side file's write lock, held for real
        try:
            save = asyncio.create_task(store.apply([Save(KEY, response(MIB), 60.0)]))
            hit = Hit(["k"], [5], [60.0])
            await asyncio.wait_for(store.apply([hit]), DEADLINE)
            assert hit.allowed
            assert used(hit) == [1]
            assert not save.done()  # the big save is still inside the side file's writer
            lookup = Lookup("s\x1fother")
            await asyncio.wait_for(store.apply([lookup]), DEADLINE)
        finally:
            holder.execute("COMMIT")
        await asyncio.wait_for(save, DEADLINE)
        ((key, blob, length),) = named(store.path)
        assert key == KEY
        assert blob is not None
        assert length == 0
        found = Lookup(KEY)
        await store.apply([found])
        assert found.result == response(MIB)
    finally:
        holder.close()
        await store.close()


async def test_small_bodies_stay_in_the_row(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        await store.apply([Save(KEY, response(64 << 10), 60.0)])
        assert named(store.path) == [(KEY, None, 64 << 10)]
        assert blobs(store.path) == 0
    finally:
        await store.close()


async def test_quotas_count_the_bodies_in_the_side_file(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        quota = Quota(scope_bytes=300 << 10, total_bytes=1 << 30)
        first = Save("a\x1f1", response(200 << 10), 60.0, scope="a", quota=quota)
        await store.apply([first])
        assert first.outcome == "saved"
        with sqlite3.connect(store.path) as conn:
            (used,) = conn.execute("SELECT bytes FROM response_bytes WHERE scope = 'a'").fetchone()
            (total,) = conn.execute("SELECT bytes FROM response_total").fetchone()
        assert used == total > 200 << 10
        second = Save("a\x1f2", response(200 << 10), 60.0, scope="a", quota=quota)
        await store.apply([second])
        assert second.outcome == "quota"
        # The refused save's body, written first, goes at once: no row names it.
        await until(lambda: blobs(store.path) == 1, "the refused body dropped")
        assert [row[0] for row in named(store.path)] == ["a\x1f1"]
    finally:
        await store.close()


@pytest.mark.usefixtures("loose_umask")
async def test_the_side_file_is_owner_only(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "data")
    await store.open()
    try:
        await store.apply([Save(KEY, response(MIB), 60.0)])
        side = blob_path(store.path)
        assert side.name == "porch-blobs.sqlite3"
        for path in side.parent.iterdir():
            if path.name.startswith(side.name):
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    finally:
        await store.close()


def file_size(path: Path) -> int:
    return path.stat().st_size


async def test_expired_big_responses_are_reclaimed_from_the_side_file(tmp_path: Path) -> None:
    clock = ManualClock(monotonic=1000.0, wall=1_700_000_000.0, boot_id="boot-a")
    store = SQLiteStore(tmp_path, clock=clock, upkeep_after=0.02)
    await store.open()
    try:
        await store.apply([Save(f"s\x1f{i}", response(MIB), 1.0) for i in range(8)])
        assert blobs(store.path) == 8
        side = blob_path(store.path)
        full = file_size(side)
        assert full > 8 * MIB
        # Expired and past the orphan grace: the idle writer prunes the rows, the side
        # file's sweep deletes the bodies no row names and gives the pages back.
        clock.advance(2.0 + ORPHAN_GRACE)
        # Upkeep runs at the writer's first idle moment after a transaction: the one after
        # the saves may have come before the clock moved (nothing expired then), so a
        # transaction now makes the next idle moment see them expired.
        await store.apply([Hit(["nudge"], [1], [60.0])])
        await until(lambda: not named(store.path), "expired rows pruned")
        await until(lambda: blobs(store.path) == 0, "expired bodies reclaimed")
        await until(lambda: file_size(side) < full // 4, "pages given back")
    finally:
        await store.close()


_CHILD = """
import asyncio, sys
from porch.store.base import Claim, Save, StoredResponse
from porch.store.sqlite import SQLiteStore

async def main():
    store = SQLiteStore(sys.argv[1])
    await store.open()
    claim = Claim(sys.argv[2])
    await store.apply([claim])
    print(claim.token, flush=True)
    sys.stdin.readline()
    body = StoredResponse(b"d" * 32, 201, (), b"y" * (1 << 20))
    await store.apply([Save(sys.argv[2], body, 60.0, token=claim.token)])
    print("saved", flush=True)

asyncio.run(main())
"""


def kill_mid_big_save(directory: Path) -> None:
    """A real process claims KEY, commits the big body in the side file and dies (kill -9)
    while its row waits for the data file's write lock, held here by another connection."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), KEY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert int(child.stdout.readline()) > 0  # the child holds the key
        blocker = sqlite3.connect(directory / "porch.sqlite3", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            child.stdin.write("go\n")
            child.stdin.flush()
            wait_until(lambda: blobs(directory / "porch.sqlite3") == 1, "the body committed first")
            child.send_signal(signal.SIGKILL)
            child.wait(DEADLINE)
        finally:
            blocker.execute("COMMIT")
            blocker.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


async def test_kill_9_between_the_body_and_its_row_leaves_an_orphan_never_a_dangling_row(
    tmp_path: Path,
) -> None:
    kill_mid_big_save(tmp_path)
    data = tmp_path / "porch.sqlite3"
    assert named(data) == []  # no row, so none naming a missing body
    # Restarted (later than the orphan grace): the key is served again, the orphan goes.
    clock = ManualClock(monotonic=10.0, wall=time.time() + ORPHAN_GRACE + 60, boot_id="b")
    store = SQLiteStore(tmp_path, clock=clock, upkeep_after=0.02)
    await store.open()
    try:
        claim = Claim(KEY)
        await store.apply([claim])
        assert claim.token > 0
        assert claim.stored is None
        await until(lambda: blobs(data) == 0, "the orphan reclaimed")
        await store.apply([Save(KEY, response(MIB, b"z"), 60.0, token=claim.token)])
        found = Lookup(KEY)
        await store.apply([found])
        assert found.result == response(MIB, b"z")
    finally:
        await store.close()


async def test_a_row_whose_body_the_side_file_lost_is_no_stored_response(tmp_path: Path) -> None:
    # What a power loss under durability="process" may leave (the files sync apart).
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        await store.apply([Save(KEY, response(MIB), 60.0)])
        with sqlite3.connect(blob_path(store.path)) as conn:
            conn.execute("DELETE FROM blobs")
        claim = Claim(KEY)
        await store.apply([claim])
        assert claim.stored is None
        assert claim.token > 0
        assert named(store.path) == []
    finally:
        await store.close()


async def test_a_row_whose_parts_the_side_file_lost_is_no_stored_response(tmp_path: Path) -> None:
    # The same for a body streamed in parts: a row never names a body not all there.
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        parts = store.capabilities.parts
        assert parts is not None
        for index in range(3):
            await parts.write(KEY, 9, index, b"p" * 1000)
        ref = Parts(9, 3, 3000)
        await parts.keep(KEY, ref, 60.0)
        stored = StoredResponse(b"d" * 32, 201, (), b"", ref)
        await store.apply([Save(KEY, stored, 60.0)])
        found = Lookup(KEY)
        await store.apply([found])
        assert found.result == stored
        with sqlite3.connect(blob_path(store.path)) as conn:
            conn.execute("DELETE FROM parts WHERE seq = 1")
        claim = Claim(KEY)
        await store.apply([claim])
        assert claim.stored is None
        assert claim.token > 0
        assert named(store.path) == []
    finally:
        await store.close()
