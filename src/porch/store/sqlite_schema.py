"""The SQLite file's schema and its migrations.

Users keep their data file across upgrades, so the schema is versioned in the
file itself (``PRAGMA user_version``) and every released version has a
migration from the one before it. Never edit a released migration: add one.
"""

from __future__ import annotations

import sqlite3

from ..errors import StoreError

__all__ = ["SCHEMA_VERSION", "migrate", "rebase_after_reboot"]

# Times: ``window_start``, ``stored_at`` and ``expires`` are seconds on the
# monotonic clock of the boot recorded in porch_meta; ``wall_start`` and
# ``stored_wall`` are Unix seconds at the same moment, used only to rebase the
# monotonic columns when the file is opened after a reboot.
_MIGRATIONS: tuple[str, ...] = (
    # 1: counters
    """
    CREATE TABLE porch_meta (
        name  TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE counters (
        key          TEXT PRIMARY KEY,
        count        INTEGER NOT NULL,
        window_start REAL NOT NULL,
        expires      REAL NOT NULL,
        wall_start   REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX counters_expires ON counters (expires);
    """,
    # 2: stored responses for idempotent replay
    """
    CREATE TABLE responses (
        key         TEXT PRIMARY KEY,
        digest      BLOB NOT NULL,
        status      INTEGER NOT NULL,
        headers     TEXT NOT NULL,
        body        BLOB NOT NULL,
        stored_at   REAL NOT NULL,
        expires     REAL NOT NULL,
        stored_wall REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX responses_expires ON responses (expires);
    """,
)

SCHEMA_VERSION = len(_MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the file to SCHEMA_VERSION in the caller's transaction; return the old version."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the data file has schema version {version}, newer than this porch "
            f"understands ({SCHEMA_VERSION}); upgrade porch"
        )
    for number in range(version, SCHEMA_VERSION):
        for statement in _MIGRATIONS[number].split(";"):
            if statement.strip():
                conn.execute(statement)
    if version != SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return int(version)


def rebase_after_reboot(conn: sqlite3.Connection, boot_id: str, mono: float, wall: float) -> bool:
    """Move windows recorded under another boot onto this boot's monotonic clock.

    The monotonic clock restarts at boot, so an old reading means nothing now.
    Elapsed time since a window started is taken from the wall clock, clamped at
    zero: a wall clock that went backwards never counts as time passed.
    Returns whether a rebase happened. Runs inside the caller's write transaction.
    """
    row = conn.execute("SELECT value FROM porch_meta WHERE name = 'boot_id'").fetchone()
    if row is not None and row[0] == boot_id:
        return False
    if row is not None:
        # Every right-hand side reads the old row, so one UPDATE is consistent.
        conn.execute(
            "UPDATE counters SET"
            " window_start = :mono - MAX(0.0, :wall - wall_start),"
            " expires = :mono - MAX(0.0, :wall - wall_start) + (expires - window_start)",
            {"mono": mono, "wall": wall},
        )
        conn.execute(
            "UPDATE responses SET"
            " stored_at = :mono - MAX(0.0, :wall - stored_wall),"
            " expires = :mono - MAX(0.0, :wall - stored_wall) + (expires - stored_at)",
            {"mono": mono, "wall": wall},
        )
    conn.execute(
        "INSERT INTO porch_meta (name, value) VALUES ('boot_id', ?)"
        " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        (boot_id,),
    )
    return row is not None
