"""Idempotency claims of the SQLite store: OFD byte-range locks on ``<store>.locks``.

A claim on a key is a write lock on one byte of the lock file, at an offset
derived from the key (a 62-bit hash). Linux open-file-description locks
(``F_OFD_SETLK``) belong to an open file, which each process opens once for
itself (never inherited: ``O_CLOEXEC``, and reopened after a fork); the kernel
drops them when that file is closed — also when the process is killed — so a
claim dies with its process and no lease has to expire. Within a process the
key pool already serializes each key, so the locks only arbitrate between
processes.

Waiting for a claim held elsewhere (:meth:`SQLiteClaims.watch`) is a daemon
thread blocked in ``F_OFD_SETLKW`` on a descriptor of its own (so it conflicts
with this process's claims too, and never shares their locks), one thread per
watched key: it unlocks as soon as it gets the lock and wakes the event loop.
No polling, no CPU while parked.

The non-blocking calls (take without waiting, release) go to libc through
``ctypes.PyDLL``, which keeps the GIL: ``fcntl.fcntl`` releases it around
every call, and on a busy loop each release handed the GIL to the store's
writer thread, twice per keyed request, which cost far more than the
microsecond syscall itself and split group commits into small transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import secrets
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from ..._files import private_file, tighten

__all__ = ["KeyLocks", "SQLiteClaims", "ofd_locks_available"]

logger = logging.getLogger("porch.store")

try:
    import fcntl

    _SETLK: int | None = fcntl.F_OFD_SETLK  # type: ignore[attr-defined,unused-ignore]
    _SETLKW: int | None = fcntl.F_OFD_SETLKW  # type: ignore[attr-defined,unused-ignore]
    _GETLK: int | None = fcntl.F_OFD_GETLK  # type: ignore[attr-defined,unused-ignore]
except (ImportError, AttributeError):  # not Linux
    _SETLK = _SETLKW = _GETLK = None

# struct flock: l_type, l_whence, l_start, l_len, l_pid (must be 0 for OFD locks).
_FLOCK = "hhqqi4x"
_OFFSETS = 1 << 62
# Bytes from 2**62 up are holders' (an open store with concurrency slots, see slots.py):
# keys' bytes lie below, so a holder's byte never meets a claim's.
_HOLDERS = 1 << 62


def ofd_locks_available() -> bool:
    """Whether this platform has open-file-description locks (Linux 3.15+)."""
    return _SETLK is not None


def _fcntl_keeping_gil() -> Callable[[int, int, bytes], int] | None:
    """libc's ``fcntl`` called with the GIL held, or None where ctypes cannot find it."""
    try:
        import ctypes

        function = ctypes.PyDLL(None, use_errno=True).fcntl
    except (ImportError, OSError, AttributeError):  # no ctypes, or no fcntl symbol
        return None
    # No argtypes: ctypes passes an int as a C int and bytes as a pointer to its buffer by
    # itself, and converting through declared argtypes cost as much as the syscall.
    function.restype = ctypes.c_int
    return function


class KeyLocks:
    """One lock file, opened once per process; a key's lock is one byte of it."""

    __slots__ = ("_fd", "_nowait", "_pid", "opened", "path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = -1
        self._pid = 0
        # Counts the descriptors this object opened: one that changed dropped every
        # lock taken on the one before (closed, or left in the parent of a fork).
        self.opened = 0
        # Only for commands that never sleep: a blocking wait must release the GIL.
        self._nowait = _fcntl_keeping_gil() if _SETLK is not None else None

    @staticmethod
    def offset(key: str) -> int:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "big") % _OFFSETS

    def _file(self) -> int:
        # A descriptor inherited through fork() would share its locks with the
        # parent: open our own in each process.
        pid = os.getpid()
        if self._pid != pid:
            private_file(self.path)  # 0600 whatever the umask
            tighten(self.path)  # found 0644 (an earlier porch made it so): ours, so 0600
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = pid
            self.opened += 1
        return self._fd

    def _fcntl(self, command: int | None, key: str, kind: int, fd: int | None = None) -> None:
        if command is None:
            raise OSError(errno.ENOSYS, "open-file-description locks need Linux")
        flock = struct.pack(_FLOCK, kind, os.SEEK_SET, self.offset(key), 1, 0)
        if fd is None:
            fd = self._file()
        if self._nowait is None or command != _SETLK:
            fcntl.fcntl(fd, command, flock)
        else:
            self._setlk(fd, flock)

    def _setlk(self, fd: int, flock: bytes) -> None:
        command = _SETLK
        if command is None:
            raise OSError(errno.ENOSYS, "open-file-description locks need Linux")
        nowait = self._nowait
        if nowait is None:
            fcntl.fcntl(fd, command, flock)
        elif nowait(fd, command, flock) == -1:
            import ctypes  # imported already: _nowait came from it

            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def lock_records(self, key: str) -> tuple[bytes, bytes]:
        """The packed lock and unlock requests for ``key``'s byte (computed once per claim:
        the hash and the packing are most of a claim's lock cost besides the syscall)."""
        offset = self.offset(key)
        return (
            struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0),
            struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0),
        )

    def file(self) -> int:
        """This process's descriptor of the lock file (opened again after a fork)."""
        return self._file()

    def try_lock(self, fd: int, lock: bytes) -> bool:
        """Take a lock packed by :meth:`lock_records` on ``fd`` (from :meth:`file`), no wait."""
        try:
            self._setlk(fd, lock)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def unlock(self, fd: int, unlock: bytes) -> None:
        """Drop a lock with the unlock record from :meth:`lock_records`."""
        self._setlk(fd, unlock)

    def try_acquire(self, key: str) -> bool:
        """Take the key's lock without waiting; False if another process holds it."""
        try:
            self._fcntl(_SETLK, key, fcntl.F_WRLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def acquire(self, key: str) -> None:
        """Wait (blocking the calling thread, not spinning) until the key's lock is ours."""
        self._wait(key, self._file())

    def wait_free(self, key: str) -> None:
        """Block the calling thread until no other opener holds the key's lock; take nothing.

        It waits on a descriptor of its own, so it also waits for this
        process's own claim, and its brief lock never mixes with those.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._wait(key, fd)
            self._fcntl(_SETLK, key, fcntl.F_UNLCK, fd)
        finally:
            os.close(fd)

    def _wait(self, key: str, fd: int) -> None:
        while True:
            try:
                self._fcntl(_SETLKW, key, fcntl.F_WRLCK, fd)
                return
            except InterruptedError:
                continue

    def take_holder(self) -> int:
        """A new holder id (> 0), its byte locked on this process's descriptor: while the
        lock is held, the holder lives (see slots.py). Raises OSError."""
        fd = self._file()
        while True:
            holder = secrets.randbits(61) + 1
            lock = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, _HOLDERS + holder, 1, 0)
            if self.try_lock(fd, lock):
                return holder

    def holder_alive(self, holder: int) -> bool:
        """Whether another open file description holds ``holder``'s byte: its store is open,
        its process alive. (This process's own descriptor conflicts with none of its own
        locks: never ask about its own holder.) Raises OSError."""
        if _GETLK is None:
            raise OSError(errno.ENOSYS, "open-file-description locks need Linux")
        probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, _HOLDERS + holder, 1, 0)
        answer = fcntl.fcntl(self._file(), _GETLK, probe)
        (kind,) = struct.unpack_from("h", answer)
        return bool(kind != fcntl.F_UNLCK)

    def release(self, key: str) -> None:
        """Drop the key's lock."""
        self._fcntl(_SETLK, key, fcntl.F_UNLCK)

    def close(self) -> None:
        """Close the lock file, dropping every lock this process holds in it."""
        if self._pid == os.getpid() and self._fd >= 0:
            os.close(self._fd)
        self._fd, self._pid = -1, 0


class _Waker:
    """One watcher of a key: wakes its event loop once, unless cancelled first."""

    __slots__ = ("cancelled", "loop", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self.loop = loop
        self.wake = wake
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        # Runs on the loop: a cancel that came after the thread scheduled this wins.
        if not self.cancelled:
            self.cancelled = True
            self.wake()


class SQLiteClaims:
    """This store's claims: which keys this process holds (with their tokens), and watches.

    ``take``/``end``/``current`` run on the store's writer thread only;
    ``watch`` runs on the event loop.
    """

    __slots__ = ("_epoch", "_guard", "_held", "_serial", "_taken", "_unlocks", "_watches", "locks")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # None where the platform has no OFD locks: claims are then per process.
        self.locks: KeyLocks | None = KeyLocks(path) if ofd_locks_available() else None
        self._held: dict[str, int] = {}  # key -> token (0 while being granted)
        self._unlocks: dict[str, bytes] = {}  # key -> its packed unlock request
        # Fence tokens are epoch << 32 | serial (see tokens()).
        self._epoch = 0
        self._serial = 0
        self._taken: list[str] = []  # taken by the transaction under way
        self._watches: dict[str, list[_Waker]] = {}
        self._guard = threading.Lock()

    # -- the writer thread ---------------------------------------------------------

    def take(self, key: str) -> bool:
        """Lock ``key`` for this process without waiting; False if it is held, here or elsewhere."""
        if key in self._held:
            return False  # held by this process (another pool on this same store object)
        locks = self.locks
        if locks is not None:
            lock, unlock = locks.lock_records(key)
            if not locks.try_lock(locks.file(), lock):
                return False
            self._unlocks[key] = unlock
        self._held[key] = 0  # taken; its token comes with grant()
        self._taken.append(key)
        return True

    def grant(self, key: str, token: int) -> None:
        """Give the claim on ``key`` taken by :meth:`take` its fence token."""
        self._held[key] = token

    def tokens(self, epoch: int, count: int) -> tuple[int, int | None]:
        """Fence tokens for ``count`` claims granted now, and the epoch to record (or None).

        ``epoch`` is the file's claim epoch, read under the transaction's write lock.
        A token is ``epoch << 32 | serial``. While the file's epoch is still the one
        this store took last, no other store has issued a token since, so this
        store's serials keep increasing on it and nothing is written; otherwise
        it takes the next epoch (written in this transaction). So tokens increase
        across every store sharing the file, and a transaction of claims writes
        no page of its own unless another process claimed in between.
        """
        new: int | None = None
        if not self._epoch or epoch != self._epoch or self._serial + count >= 1 << 32:
            new = epoch + 1
            self._epoch, self._serial = new, 0
        first = self._epoch << 32 | (self._serial + 1)
        self._serial += count
        return first, new

    def current(self, key: str, token: int) -> bool:
        """Whether ``token`` is the claim this process holds on ``key``."""
        return token > 0 and self._held.get(key) == token

    def holds_any(self) -> bool:
        return bool(self._held)

    def end(self, key: str) -> None:
        """Forget the claim on ``key`` and unlock it (waking this process's own watchers)."""
        if self._held.pop(key, None) is None:
            return
        locks = self.locks
        if locks is None:
            self._wake(key)  # no lock file: watchers of this process are woken here
            return
        unlock = self._unlocks.pop(key, None)
        try:
            if unlock is None:
                locks.release(key)
            else:
                locks.unlock(locks.file(), unlock)
        except OSError as exc:  # the lock goes with the file at exit anyway
            logger.error("porch: releasing the claim on an idempotency key failed: %s", exc)

    def committed(self) -> None:
        """The transaction committed: the claims it took stay held."""
        self._taken.clear()

    def rolled_back(self) -> None:
        """The transaction rolled back: the claims it took are ended."""
        taken, self._taken = self._taken, []
        # Its epoch write (if any) is undone, so another store may take that epoch
        # next: this store takes a fresh one at its next claim.
        self._epoch = self._serial = 0
        for key in taken:
            if self._held.get(key) is not None:
                self.end(key)

    # -- the event loop ------------------------------------------------------------

    def watch(
        self, key: str, wake: Callable[[], None], retry_after: float | None
    ) -> Callable[[], None]:
        """Call ``wake()`` on this loop once ``key``'s lock is free (holder done or dead).

        ``retry_after`` is ignored: an OFD lock has no lease, it dies with its holder.
        """
        waker = _Waker(asyncio.get_running_loop(), wake)
        locks = self.locks
        with self._guard:
            wakers = self._watches.get(key)
            if wakers is not None:  # a thread already waits for this key: share it
                wakers.append(waker)
                return waker.cancel
            self._watches[key] = [waker]
        if locks is None:
            # Only this process can hold a claim here: end() wakes the watchers, and a
            # claim that ended before the watch was registered is woken for at once.
            if key not in self._held:
                self._wake(key)
            return waker.cancel
        threading.Thread(
            target=self._wait, args=(locks, key), name="porch-claim-watch", daemon=True
        ).start()
        return waker.cancel

    def _wait(self, locks: KeyLocks, key: str) -> None:
        try:
            locks.wait_free(key)
        except OSError as exc:
            # Wake anyway: the caller claims again, and a real failure surfaces there.
            logger.error("porch: waiting for the claim on an idempotency key failed: %s", exc)
        self._wake(key)

    def _wake(self, key: str) -> None:
        with self._guard:
            wakers = self._watches.pop(key, ())
        for waker in wakers:
            if not waker.cancelled:
                # A closed loop has nobody left to wake.
                with contextlib.suppress(RuntimeError):
                    waker.loop.call_soon_threadsafe(waker.fire)

    def close(self) -> None:
        """Drop every claim of this process (closing the lock file) and cancel every watch."""
        with self._guard:
            for wakers in self._watches.values():
                for waker in wakers:
                    waker.cancelled = True
            self._watches.clear()
        self._held.clear()
        self._unlocks.clear()
        if self.locks is not None:
            self.locks.close()
