from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from porch.locks import KeyLocks, ofd_locks_available

pytestmark = pytest.mark.skipif(not ofd_locks_available(), reason="needs Linux OFD locks")


def test_a_held_key_cannot_be_taken_until_released(tmp_path: Path) -> None:
    locks = KeyLocks(tmp_path / "k.locks")
    fd = locks.try_acquire("order-1")
    assert fd is not None
    # Same process, another open file description: still excluded (OFD semantics).
    assert locks.try_acquire("order-1") is None
    other = locks.try_acquire("order-2")
    assert other is not None
    locks.release(fd)
    again = locks.try_acquire("order-1")
    assert again is not None
    locks.release(again)
    locks.release(other)


def test_a_waiter_blocks_without_spinning_until_release(tmp_path: Path) -> None:
    locks = KeyLocks(tmp_path / "k.locks")
    fd = locks.try_acquire("k")
    assert fd is not None
    got: list[int] = []
    cpu: list[float] = []

    def wait() -> None:
        start = time.thread_time()
        got.append(locks.acquire("k"))
        cpu.append(time.thread_time() - start)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)
    assert got == []
    locks.release(fd)
    thread.join(5)
    assert len(got) == 1
    assert cpu[0] < 0.05  # half a second parked in the kernel, not polling
    locks.release(got[0])


def test_a_killed_owner_frees_its_key_at_once(tmp_path: Path) -> None:
    path = tmp_path / "k.locks"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from porch.locks import KeyLocks;"
            f"fd = KeyLocks({str(path)!r}).try_acquire('k'); print(fd is not None, flush=True);"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "True"
        locks = KeyLocks(path)
        assert locks.try_acquire("k") is None
        holder.kill()
        holder.wait(5)
        fd = locks.try_acquire("k")
        assert fd is not None  # no lease to expire: the kernel dropped it with the process
        locks.release(fd)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_offsets_are_stable_and_spread() -> None:
    assert KeyLocks.offset("a") == KeyLocks.offset("a")
    assert len({KeyLocks.offset(f"k{i}") for i in range(1000)}) == 1000
    assert os.path.basename(str(KeyLocks("x/y.locks").path)) == "y.locks"
