"""Key ownership across the processes of one host: OFD byte-range locks on a lock file.

An idempotency owner holds a write lock on one byte of ``<store>.locks``, at an
offset derived from the key. Linux open-file-description locks (``F_OFD_SETLK``)
belong to the open file, not to the process, so two owners in the same process
exclude each other too; and the kernel drops them when the file is closed —
also when the process is killed — so ownership dies with its process and no
lease has to expire. A waiter blocks in ``F_OFD_SETLKW`` in a thread of its
own: no polling, no CPU.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
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


class KeyLocks:
    """One lock file; ``try_acquire`` and ``acquire`` return an open descriptor that holds
    the key's lock until :meth:`release` closes it."""

    __slots__ = ("path",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @staticmethod
    def offset(key: str) -> int:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "big") % _OFFSETS

    def _flock(self, key: str, kind: int) -> bytes:
        return struct.pack(_FLOCK, kind, os.SEEK_SET, self.offset(key), 1, 0)

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def try_acquire(self, key: str) -> int | None:
        """Take the key's lock without waiting; None if another owner holds it."""
        if _SETLK is None:
            raise OSError(errno.ENOSYS, "open-file-description locks need Linux")
        fd = self._open()
        try:
            fcntl.fcntl(fd, _SETLK, self._flock(key, fcntl.F_WRLCK))
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def acquire(self, key: str) -> int:
        """Wait (blocking the calling thread, not spinning) until the key's lock is ours."""
        if _SETLKW is None:
            raise OSError(errno.ENOSYS, "open-file-description locks need Linux")
        fd = self._open()
        try:
            while True:
                try:
                    fcntl.fcntl(fd, _SETLKW, self._flock(key, fcntl.F_WRLCK))
                    return fd
                except InterruptedError:
                    continue
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def release(fd: int) -> None:
        """Drop the lock (closing the descriptor releases it)."""
        os.close(fd)
