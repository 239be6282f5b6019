from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from porch.clock import ManualClock
from porch.errors import StoreError
from porch.store.base import Claim, Hit, Lookup, Quota, Release, Save, StoredResponse
from porch.store.sqlite import SQLiteStore
from porch.store.sqlite.claims import KeyLocks, SQLiteClaims, ofd_locks_available
from support import spin, until

pytestmark = pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")


def test_a_held_key_cannot_be_taken_by_another_opener_until_released(tmp_path: Path) -> None:
    # Two KeyLocks on one file are two open file descriptions: what two worker
    # processes are to each other.
    mine, theirs = KeyLocks(tmp_path / "k.locks"), KeyLocks(tmp_path / "k.locks")
    try:
        assert mine.try_acquire("order-1")
        assert not theirs.try_acquire("order-1")
        assert theirs.try_acquire("order-2")
        mine.release("order-1")
        assert theirs.try_acquire("order-1")
    finally:
        mine.close()
        theirs.close()


def test_a_waiter_blocks_without_spinning_until_release(tmp_path: Path) -> None:
    mine, theirs = KeyLocks(tmp_path / "k.locks"), KeyLocks(tmp_path / "k.locks")
    assert mine.try_acquire("k")
    got = threading.Event()
    cpu: list[float] = []

    def wait() -> None:
        start = time.thread_time()
        theirs.acquire("k")
        cpu.append(time.thread_time() - start)
        got.set()

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        assert not got.wait(0.5)
        mine.release("k")
        assert got.wait(5)
        assert cpu[0] < 0.05  # half a second parked in the kernel, not polling
    finally:
        thread.join(5)
        mine.close()
        theirs.close()


def test_closing_drops_every_lock(tmp_path: Path) -> None:
    mine, theirs = KeyLocks(tmp_path / "k.locks"), KeyLocks(tmp_path / "k.locks")
    assert mine.try_acquire("a")
    assert mine.try_acquire("b")
    mine.close()
    assert theirs.try_acquire("a")
    assert theirs.try_acquire("b")
    theirs.close()


def test_a_killed_owner_frees_its_key_at_once(tmp_path: Path) -> None:
    path = tmp_path / "k.locks"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from porch.store.sqlite.claims import KeyLocks;"
            f"print(KeyLocks({str(path)!r}).try_acquire('k'), flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    locks = KeyLocks(path)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "True"
        assert not locks.try_acquire("k")
        holder.kill()
        holder.wait(5)
        # No lease to expire: the kernel dropped the lock with the process.
        assert locks.try_acquire("k")
    finally:
        locks.close()
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def test_offsets_are_stable_and_spread() -> None:
    assert KeyLocks.offset("a") == KeyLocks.offset("a")
    assert len({KeyLocks.offset(f"k{i}") for i in range(1000)}) == 1000


@pytest.mark.anyio
async def test_closing_the_store_drops_its_key_locks(tmp_path: Path) -> None:
    from porch.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path)
    await store.open()
    locks = store._claims.locks
    assert locks is not None
    assert locks.try_acquire("k")
    other = KeyLocks(locks.path)
    try:
        assert not other.try_acquire("k")
        await store.close()
        assert other.try_acquire("k")
    finally:
        other.close()


# -- the seam's claim ops on SQLite ----------------------------------------------------------

RESPONSE = StoredResponse(b"digest", 201, ((b"content-type", b"text/plain"),), b"created")


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[SQLiteStore, SQLiteStore]]:
    """Two stores on one file: two openers of the lock file, as two processes are."""
    clock = ManualClock()
    mine, theirs = SQLiteStore(tmp_path, clock=clock), SQLiteStore(tmp_path, clock=clock)
    await mine.open()
    await theirs.open()
    yield mine, theirs
    await mine.close()
    await theirs.close()


async def claim(store: SQLiteStore, key: str = "s\x1fk") -> Claim:
    op = Claim(key)
    await store.apply([op])
    return op


async def save(
    store: SQLiteStore,
    token: int,
    key: str = "s\x1fk",
    response: StoredResponse = RESPONSE,
    quota: Quota | None = None,
    ttl: float = 60.0,
) -> Save:
    op = Save(key, response, ttl, token=token, scope=key.split("\x1f")[0], quota=quota)
    await store.apply([op])
    return op


@pytest.mark.anyio
async def test_a_claim_excludes_other_openers_until_saved_then_they_find_the_response(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    mine, theirs = stores
    first = await claim(mine)
    assert (first.token > 0, first.held, first.stored) == (True, False, None)
    other = await claim(theirs)
    # Held elsewhere; an OFD lock has no lease, so there is nothing to wait out.
    assert (other.held, other.token, other.retry_after, other.stored) == (True, 0, None, None)
    assert (await save(mine, first.token)).outcome == "saved"
    after = await claim(theirs)
    assert (after.stored, after.token, after.held) == (RESPONSE, 0, False)
    # Answered from the store: nothing stays claimed.
    assert (await claim(mine)).stored == RESPONSE


@pytest.mark.anyio
async def test_release_frees_the_key_and_tokens_increase_across_openers(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    mine, theirs = stores
    first = await claim(mine)
    release = Release("s\x1fk", first.token)
    await mine.apply([release])
    assert release.released
    second = await claim(theirs)
    assert second.token > first.token
    # A stale token releases nothing, and saves nothing.
    stale = Release("s\x1fk", first.token)
    await mine.apply([stale])
    assert not stale.released
    assert (await claim(mine)).held


@pytest.mark.anyio
async def test_a_save_with_a_stale_token_is_fenced_and_writes_nothing(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    mine, theirs = stores
    first = await claim(mine)
    fenced = await save(mine, first.token + 1000)
    assert fenced.outcome == "fenced"
    assert (await claim(theirs)).held  # the real claim is untouched
    assert (await save(mine, first.token)).outcome == "saved"
    late = await save(mine, first.token, response=StoredResponse(b"digest", 200, (), b"stale"))
    assert late.outcome == "fenced"
    assert (await claim(theirs)).stored == RESPONSE


def _broken() -> Hit:
    """A hit whose inputs make the batch fail after its claims and saves were applied."""
    return Hit(["x", "y"], [1], [1.0])


@pytest.mark.anyio
async def test_a_rolled_back_transaction_ends_the_claims_it_took_and_was_ending(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    mine, theirs = stores
    taken = Claim("s\x1fa")
    with pytest.raises(StoreError):
        await mine.apply([taken, _broken()])
    assert (await claim(theirs, "s\x1fa")).token > 0
    held = await claim(mine, "s\x1fb")
    with pytest.raises(StoreError):
        await mine.apply([Save("s\x1fb", RESPONSE, 60.0, token=held.token), _broken()])
    again = await claim(theirs, "s\x1fb")
    assert (again.token > 0, again.stored) == (True, None)  # ended, nothing stored


@pytest.mark.anyio
async def test_quota_per_scope_counts_live_bytes_only(tmp_path: Path) -> None:
    clock = ManualClock()
    store = SQLiteStore(tmp_path, clock=clock)
    await store.open()
    try:
        body = StoredResponse(b"d", 200, (), b"x" * 1000)
        quota = Quota(scope_bytes=2500, total_bytes=10_000)
        outcomes = []
        for i in range(3):
            c = await claim(store, f"alice\x1f{i}")
            outcomes.append((await save(store, c.token, f"alice\x1f{i}", body, quota, 30)).outcome)
        assert outcomes == ["saved", "saved", "quota"]
        # Over quota: nothing stored, and the claim ended all the same.
        assert (await claim(store, "alice\x1f2")).token > 0
        # Another scope has its own allowance.
        c = await claim(store, "bob\x1f0")
        assert (await save(store, c.token, "bob\x1f0", body, quota)).outcome == "saved"
        clock.advance(31)  # alice's rows expired: reclaimed, so they no longer count
        c = await claim(store, "alice\x1f3")
        assert (await save(store, c.token, "alice\x1f3", body, quota)).outcome == "saved"
    finally:
        await store.close()
    with sqlite3.connect(store.path) as conn:
        keys = sorted(k for (k,) in conn.execute("SELECT key FROM responses"))
        assert keys == ["alice\x1f3", "bob\x1f0"]
        totals = dict(conn.execute("SELECT scope, bytes FROM response_bytes"))
        sizes = dict(conn.execute("SELECT scope, SUM(size) FROM responses GROUP BY scope"))
        assert totals == sizes
        assert conn.execute("SELECT bytes FROM response_total").fetchone()[0] == sum(sizes.values())


@pytest.mark.anyio
async def test_quota_caps_the_whole_store(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        body = StoredResponse(b"d", 200, (), b"x" * 1000)
        quota = Quota(scope_bytes=5000, total_bytes=2500)
        outcomes = []
        for scope in ("a", "b", "c"):
            c = await claim(store, f"{scope}\x1fk")
            outcomes.append((await save(store, c.token, f"{scope}\x1fk", body, quota)).outcome)
        assert outcomes == ["saved", "saved", "quota"]
    finally:
        await store.close()


@pytest.mark.anyio
async def test_one_batch_counts_its_own_bytes_in_order(tmp_path: Path) -> None:
    # As on PostgreSQL (tests/store/postgres/test_schema.py): a claim's reservation sees
    # what the batch's earlier releases freed and earlier saves took, and nothing later.
    # (Claims and writes on different keys: the batch reads and writes each in bulk.)
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        quota = Quota(scope_bytes=10_000, total_bytes=10_000, client_bytes=240)

        def mine(key: str) -> Claim:
            return Claim(key, scope="a", client="c", quota=quota, reserve=200)

        def sized(n: int) -> StoredResponse:
            return StoredResponse(b"d", 200, (), b"x" * n)

        held = mine("a1")
        await store.apply([held])
        assert held.token > 0  # 200 of the client's 240, committed
        early = mine("a2")  # 400: over
        release = Release("a1", held.token, scope="a", client="c")  # 0
        late = mine("a3")  # 200
        await store.apply([early, release, late])
        assert (early.over, release.released, late.token > 0) == ("client", True, True)
        # A save replaces its claim's reservation by its size (~23) before the next claim.
        saved = Save("a3", sized(20), 60.0, token=late.token, scope="a", client="c", quota=quota)
        after = mine("a4")  # 223
        await store.apply([saved, after])
        assert (saved.outcome, after.token > 0) == ("saved", True)
        await store.apply([Release("a4", after.token, scope="a", client="c")])  # 23
        # A save's new bytes count before a later claim: its reservation no longer fits.
        taken = Save("a5", sized(20), 60.0, scope="a", client="c", quota=quota)  # 46
        refused = mine("a6")  # 246: over
        await store.apply([taken, refused])
        assert (taken.outcome, refused.token, refused.over) == ("saved", 0, "client")
    finally:
        await store.close()


@pytest.mark.anyio
async def test_a_saved_row_counts_once_after_a_reclaim_in_its_batch(tmp_path: Path) -> None:
    # A key both read and written keeps its batch in arrival order, its saves' rows written
    # one op at a time; a reclaim later in the batch reads the figures again from tables
    # that already hold those rows.
    quota = Quota(scope_bytes=10_000, total_bytes=10_000, client_bytes=240)
    gone = SQLiteStore(tmp_path)
    await gone.open()
    await gone.apply([Claim("z", scope="a", client="c", quota=quota, reserve=30)])
    await gone.close()  # its lock dropped, its reservation left: a dead holder's (30)
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        held = Claim("x", scope="a", client="c", quota=quota, reserve=100)
        await store.apply([held])  # 130
        body = StoredResponse(b"d", 200, (), b"x" * 20)
        saved = Save("x", body, 60.0, token=held.token, scope="a", client="c", quota=quota)
        after = Claim("y", scope="a", client="c", quota=quota, reserve=200)
        # 30 + 22 + 200 is over the cap: z's 30 is reclaimed, then 22 + 200 fits (counting
        # the saved 22 twice, 244, did not).
        await store.apply([saved, Lookup("x"), after])
        assert (saved.outcome, saved.size, after.token > 0, after.over) == ("saved", 22, True, None)
    finally:
        await store.close()


@pytest.mark.anyio
async def test_watch_wakes_when_the_holder_releases_and_cancel_silences_it(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    mine, theirs = stores
    held = await claim(mine)
    assert (await claim(theirs)).held
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[str] = loop.create_future()
    phase = ["watching"]  # the test's step, read by the wake: an early one shows at the end
    silenced: list[int] = []
    theirs.claims.watch("s\x1fk", lambda: woken.set_result(phase[0]), None)
    cancel = theirs.claims.watch("s\x1fk", lambda: silenced.append(1), None)
    cancel()
    phase[0] = "releasing"
    await mine.apply([Release("s\x1fk", held.token)])
    assert await asyncio.wait_for(woken, 10) == "releasing"  # not before the release
    # Both watches share the key's one waiting thread, whose wake schedules them together:
    # a wrongly woken cancelled one would be a few loop turns behind, at most.
    await spin()
    assert silenced == []  # cancelled before the wake: a late wake is a no-op
    assert (await claim(theirs)).token > 0


def waits_in_the_kernel(path: Path) -> bool:
    """Whether a lock request on ``path`` is blocked (a ``->`` line of /proc/locks)."""
    inode = path.stat().st_ino
    with open("/proc/locks") as listing:
        for line in listing:
            # "1: -> OFDLCK ADVISORY WRITE -1 <major>:<minor>:<inode> <start> <end>"
            fields = line.split()
            if len(fields) > 6 and fields[1] == "->" and fields[6].endswith(f":{inode}"):
                return True
    return False


_HOLDER = """
import asyncio, sys
from porch.store.base import Claim
from porch.store.sqlite import SQLiteStore

async def main():
    store = SQLiteStore(sys.argv[1])
    await store.open()
    claim = Claim("s\\x1fk")
    await store.apply([claim])
    print(claim.token, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.mark.anyio
async def test_a_killed_holder_frees_its_claim_and_wakes_a_watcher(tmp_path: Path) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, str(tmp_path), stdout=subprocess.PIPE
    )
    store = SQLiteStore(tmp_path)
    await store.open()
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 30)
        assert int(line) > 0
        assert (await claim(store)).held
        woken: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        phase = ["watching"]  # the test's step, read by the wake: an early one shows below
        store.claims.watch("s\x1fk", lambda: woken.set_result(phase[0]), None)
        lock_file = store.path.with_name(store.path.name + ".locks")
        await until(lambda: waits_in_the_kernel(lock_file), "the watch parked on the lock")
        phase[0] = "killed"
        holder.kill()  # SIGKILL: no clean-up runs in the holder
        # Parked in the kernel while the holder lived: woken by its death, not before.
        assert await asyncio.wait_for(woken, 10) == "killed"
        mine = await claim(store)
        assert mine.token > int(line)
    finally:
        if holder.returncode is None:
            holder.kill()
        await holder.wait()
        await store.close()


def _epoch(store: SQLiteStore) -> str:
    with sqlite3.connect(store.path) as conn:
        row = conn.execute("SELECT value FROM porch_meta WHERE name = 'claim_token'").fetchone()
    (value,) = row
    return str(value)


@pytest.mark.anyio
async def test_tokens_increase_over_alternating_openers_and_claims_alone_write_nothing(
    stores: tuple[SQLiteStore, SQLiteStore],
) -> None:
    mine, theirs = stores
    tokens: list[int] = []
    for round_ in range(3):
        for store in (mine, theirs, theirs, mine, mine):
            op = await claim(store, f"s\x1fk{round_}")
            tokens.append(op.token)
            await store.apply([Release(op.key, op.token)])
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)
    # While only one opener claims, its claims take tokens without writing the epoch.
    epoch = _epoch(mine)
    more = [await claim(mine, f"s\x1fonly{i}") for i in range(5)]
    assert _epoch(mine) == epoch
    assert [op.token for op in more] == list(range(more[0].token, more[0].token + 5))
    assert more[0].token > tokens[-1]


def test_a_rolled_back_epoch_is_never_shared() -> None:
    # Two stores' claim state, one file's epoch, a transaction that rolls back.
    mine, theirs = SQLiteClaims("/nonexistent/a"), SQLiteClaims("/nonexistent/b")
    file_epoch = 7
    first, new = mine.tokens(file_epoch, 2)
    assert (first, new) == (8 << 32 | 1, 8)
    mine.rolled_back()  # the epoch write is undone: the file says 7 again
    # The other store takes epoch 8 now; mine, claiming next, must take another one.
    their_first, their_new = theirs.tokens(file_epoch, 1)
    assert (their_first, their_new) == (8 << 32 | 1, 8)
    file_epoch = 8
    again, mine_new = mine.tokens(file_epoch, 1)
    assert (again, mine_new) == (9 << 32 | 1, 9)
    # Their next token, after mine took epoch 9, moves past it as well.
    later, their_next = theirs.tokens(9, 1)
    assert later > again
    assert their_next == 10
