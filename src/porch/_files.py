"""Owner-only files: the store holds client addresses and response bodies.

Modes are set with chmod after creation, not through ``open``'s mode argument
alone: the umask can only take bits away, and an odd one (0o277) would take the
owner's own. SQLite gives a database's ``-wal`` and ``-shm`` files the mode of
the database file, so creating that file 0600 before SQLite opens it covers them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["private_directory", "private_file", "tighten"]

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


def private_directory(path: Path) -> None:
    """Create ``path`` (and missing parents) if absent; a directory porch creates is 0700.

    An existing directory is left as it is: it is the operator's.
    """
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIRECTORY_MODE)
    except FileExistsError:
        return  # another worker created it first; its creator set the mode
    os.chmod(path, DIRECTORY_MODE)


def private_file(path: Path) -> None:
    """Create ``path`` empty and 0600 if absent; an existing file is left as it is
    (see :func:`tighten`, once it is known to be porch's)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def tighten(path: Path) -> None:
    """Make an existing file 0600 if others may read it (one created 0644 by an earlier
    version); absent, or owned by someone else (chmod refused): nothing."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, FILE_MODE)
