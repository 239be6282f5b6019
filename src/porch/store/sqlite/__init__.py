"""The embedded SQLite store: one WAL file, one writer thread, claims on OFD file locks."""

from .store import SQLiteStore

__all__ = ["SQLiteStore"]
