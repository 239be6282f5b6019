"""Key ownership across the processes of one host: OFD byte-range locks on a lock file.

An idempotency owner holds a write lock on one byte of ``<store>.locks``, at an
offset derived from the key (a 62-bit hash). Linux open-file-description locks
(``F_OFD_SETLK``) belong to an open file, which each process opens once for
itself (never inherited: ``O_CLOEXEC``, and reopened after a fork); the kernel
drops them when that file is closed — also when the process is killed — so
ownership dies with its process and no lease has to expire. Within a process
the key pool already serializes each key, so the locks only arbitrate between
processes. A waiter blocks in ``F_OFD_SETLKW`` in a thread of its own: no
polling, no CPU.

The non-blocking calls (take without waiting, release) go to libc through
``ctypes.PyDLL``, which keeps the GIL: ``fcntl.fcntl`` releases it around
every call, and on a busy loop each release handed the GIL to the store's
writer thread, twice per keyed request, which cost far more than the
microsecond syscall itself and split group commits into small transactions.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from collections.abc import Callable
from pathlib import Path

__all__ = ["KeyLocks", "ofd_locks_available"]

try:
    import fcntl

    _SETLK: int | None = fcntl.F_OFD_SETLK  # type: ignore[attr-defined,unused-ignore]
    _SETLKW: int | None = fcntl.F_OFD_SETLKW  # type: ignore[attr-defined,unused-ignore]
except (ImportError, AttributeError):  # not Linux
    _SETLK = _SETLKW = None

# struct flock: l_type, l_whence, l_start, l_len, l_pid (must be 0 for OFD locks).
_FLOCK = "hhqqi4x"
_OFFSETS = 1 << 62


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
    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_char_p)
    function.restype = ctypes.c_int
    return function


class KeyLocks:
    """One lock file, opened once per process; a key's lock is one byte of it."""

    __slots__ = ("_fd", "_nowait", "_pid", "path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = -1
        self._pid = 0
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
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = pid
        return self._fd

    def _fcntl(self, command: int | None, key: str, kind: int) -> None:
        if command is None:
            raise OSError(errno.ENOSYS, "open-file-description locks need Linux")
        flock = struct.pack(_FLOCK, kind, os.SEEK_SET, self.offset(key), 1, 0)
        nowait = self._nowait
        if nowait is None or command != _SETLK:
            fcntl.fcntl(self._file(), command, flock)
        elif nowait(self._file(), command, flock) == -1:
            import ctypes  # imported already: _nowait came from it

            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

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
        while True:
            try:
                self._fcntl(_SETLKW, key, fcntl.F_WRLCK)
                return
            except InterruptedError:
                continue

    def release(self, key: str) -> None:
        """Drop the key's lock."""
        self._fcntl(_SETLK, key, fcntl.F_UNLCK)

    def close(self) -> None:
        """Close the lock file, dropping every lock this process holds in it."""
        if self._pid == os.getpid() and self._fd >= 0:
            os.close(self._fd)
        self._fd, self._pid = -1, 0
