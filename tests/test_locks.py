from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from porch.locks import KeyLocks, ofd_locks_available

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
            "import time; from porch.locks import KeyLocks;"
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


def test_offsets_are_stable_and_spread() -> None:
    assert KeyLocks.offset("a") == KeyLocks.offset("a")
    assert len({KeyLocks.offset(f"k{i}") for i in range(1000)}) == 1000


@pytest.mark.anyio
async def test_closing_the_store_drops_its_key_locks(tmp_path: Path) -> None:
    from porch.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path)
    await store.open()
    assert store.locks is not None
    assert store.locks.try_acquire("k")
    other = KeyLocks(store.locks.path)
    try:
        assert not other.try_acquire("k")
        await store.close()
        assert other.try_acquire("k")
    finally:
        other.close()
