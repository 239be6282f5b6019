"""The SQLite file's schema and its migrations.

Users keep their data file across upgrades, so the schema is versioned in the
file itself (``PRAGMA user_version``) and every released version has a
migration from the one before it. Never edit a released migration: add one.
"""

from __future__ import annotations

import sqlite3
from secrets import token_hex

from ...errors import StoreError
from ..base import SECRET_BYTES

__all__ = [
    "SCHEMA_VERSION",
    "check_not_foreign",
    "enable_incremental_vacuum",
    "migrate",
    "read_secret",
    "rebase_after_reboot",
    "statements",
]

# The triggers that keep stored bytes per scope and in total exact (migration 3); a
# migration that rebuilds the responses table (5) creates them again, the same.
_RESPONSE_BYTES_TRIGGERS = """
    CREATE TRIGGER responses_bytes_insert AFTER INSERT ON responses BEGIN
        INSERT INTO response_bytes (scope, bytes) VALUES (new.scope, new.size)
            ON CONFLICT (scope) DO UPDATE SET bytes = bytes + excluded.bytes;
        UPDATE response_total SET bytes = bytes + new.size;
    END;
    CREATE TRIGGER responses_bytes_delete AFTER DELETE ON responses BEGIN
        UPDATE response_bytes SET bytes = bytes - old.size WHERE scope = old.scope;
        DELETE FROM response_bytes WHERE scope = old.scope AND bytes <= 0;
        UPDATE response_total SET bytes = bytes - old.size;
    END;
    CREATE TRIGGER responses_bytes_update AFTER UPDATE OF scope, size ON responses BEGIN
        UPDATE response_bytes SET bytes = bytes - old.size WHERE scope = old.scope;
        DELETE FROM response_bytes WHERE scope = old.scope AND bytes <= 0;
        INSERT INTO response_bytes (scope, bytes) VALUES (new.scope, new.size)
            ON CONFLICT (scope) DO UPDATE SET bytes = bytes + excluded.bytes;
        UPDATE response_total SET bytes = bytes - old.size + new.size;
    END;
"""

# From schema 8: the running totals per scope, per client and in all, kept by stored
# responses and by the reservations of claims alike (the same triggers on both tables).
_BYTES_TRIGGERS_V8 = """
    CREATE TRIGGER {table}_bytes_insert AFTER INSERT ON {table} BEGIN
        INSERT INTO response_bytes (scope, bytes) VALUES (new.scope, new.size)
            ON CONFLICT (scope) DO UPDATE SET bytes = bytes + excluded.bytes;
        INSERT INTO client_bytes (client, bytes) VALUES (new.client, new.size)
            ON CONFLICT (client) DO UPDATE SET bytes = bytes + excluded.bytes;
        UPDATE response_total SET bytes = bytes + new.size;
    END;
    CREATE TRIGGER {table}_bytes_delete AFTER DELETE ON {table} BEGIN
        UPDATE response_bytes SET bytes = bytes - old.size WHERE scope = old.scope;
        DELETE FROM response_bytes WHERE scope = old.scope AND bytes <= 0;
        UPDATE client_bytes SET bytes = bytes - old.size WHERE client = old.client;
        DELETE FROM client_bytes WHERE client = old.client AND bytes <= 0;
        UPDATE response_total SET bytes = bytes - old.size;
    END;
    CREATE TRIGGER {table}_bytes_update AFTER UPDATE OF scope, client, size ON {table} BEGIN
        UPDATE response_bytes SET bytes = bytes - old.size WHERE scope = old.scope;
        DELETE FROM response_bytes WHERE scope = old.scope AND bytes <= 0;
        INSERT INTO response_bytes (scope, bytes) VALUES (new.scope, new.size)
            ON CONFLICT (scope) DO UPDATE SET bytes = bytes + excluded.bytes;
        UPDATE client_bytes SET bytes = bytes - old.size WHERE client = old.client;
        DELETE FROM client_bytes WHERE client = old.client AND bytes <= 0;
        INSERT INTO client_bytes (client, bytes) VALUES (new.client, new.size)
            ON CONFLICT (client) DO UPDATE SET bytes = bytes + excluded.bytes;
        UPDATE response_total SET bytes = bytes - old.size + new.size;
    END;
"""

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
    # 3: fence tokens for claims; stored bytes per caller scope and in total, for quotas.
    # Existing rows get the scope their key starts with (scope + US + key) and their size.
    # Triggers keep the running totals exact on every insert, update and delete
    # (saves, pruning, expiry on touch), so a quota check reads two rows. No index
    # on scope: it cost more on every save than it saves on the rare reclaim,
    # which deletes every expired row through responses_expires instead.
    """
    INSERT INTO porch_meta (name, value) VALUES ('claim_token', '0');
    ALTER TABLE responses ADD COLUMN scope TEXT NOT NULL DEFAULT '';
    ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0;
    UPDATE responses SET
        scope = CASE WHEN instr(key, char(31)) > 0
                THEN substr(key, 1, instr(key, char(31)) - 1) ELSE '' END,
        size = length(CAST(key AS BLOB)) + length(digest) + length(CAST(headers AS BLOB))
               + length(body);
    CREATE TABLE response_bytes (
        scope TEXT PRIMARY KEY,
        bytes INTEGER NOT NULL
    ) WITHOUT ROWID;
    INSERT INTO response_bytes (scope, bytes)
        SELECT scope, SUM(size) FROM responses GROUP BY scope;
    CREATE TABLE response_total (
        id    INTEGER PRIMARY KEY CHECK (id = 1),
        bytes INTEGER NOT NULL
    );
    INSERT INTO response_total (id, bytes) SELECT 1, COALESCE(SUM(size), 0) FROM responses;
    """
    + _RESPONSE_BYTES_TRIGGERS,
    # 4: compact counter rows. A counter key is ``rl US rule US limit US client``: its
    # first three fields (the prefix, one per rule and limit) are stored once in
    # counter_names, and a row of ``counts`` holds the prefix's small id and the client
    # part only (about a third of the old row for an IPv4 client), so a million clients
    # fill a third of the pages. ``counters`` stays as a read-only view with the full
    # key (and deletable through its trigger), for operators' SQL and old tests.
    # Existing rows move over; the split is the writer's (split_key in counters.py).
    """
    CREATE TABLE counter_names (
        id     INTEGER PRIMARY KEY,
        prefix TEXT NOT NULL UNIQUE
    );
    CREATE TEMP TABLE porch_split AS
        WITH a AS (SELECT *, instr(key, char(31)) AS i1 FROM counters),
        b AS (SELECT *, CASE WHEN i1 > 0
                 THEN instr(substr(key, i1 + 1), char(31)) ELSE 0 END AS i2 FROM a),
        c AS (SELECT *, CASE WHEN i2 > 0
                 THEN instr(substr(key, i1 + i2 + 1), char(31)) ELSE 0 END AS i3 FROM b)
        SELECT key, count, window_start, expires, wall_start,
               CASE WHEN i3 > 0 THEN i1 + i2 + i3 ELSE 0 END AS cut FROM c;
    INSERT INTO counter_names (prefix)
        SELECT DISTINCT substr(key, 1, cut) FROM porch_split ORDER BY 1;
    CREATE TABLE counts (
        name         INTEGER NOT NULL,
        client       TEXT NOT NULL,
        count        INTEGER NOT NULL,
        window_start REAL NOT NULL,
        expires      REAL NOT NULL,
        wall_start   REAL NOT NULL,
        PRIMARY KEY (name, client)
    ) WITHOUT ROWID;
    INSERT INTO counts (name, client, count, window_start, expires, wall_start)
        SELECT n.id, substr(s.key, s.cut + 1), s.count, s.window_start, s.expires, s.wall_start
        FROM porch_split s JOIN counter_names n ON n.prefix = substr(s.key, 1, s.cut);
    DROP TABLE porch_split;
    DROP TABLE counters;
    CREATE INDEX counts_expires ON counts (expires);
    CREATE VIEW counters (key, count, window_start, expires, wall_start, name, client) AS
        SELECT n.prefix || c.client, c.count, c.window_start, c.expires, c.wall_start,
               c.name, c.client
        FROM counts c JOIN counter_names n ON n.id = c.name;
    CREATE TRIGGER counters_delete INSTEAD OF DELETE ON counters BEGIN
        DELETE FROM counts WHERE name = old.name AND client = old.client;
    END;
    """,
    # 5: stored responses in a rowid table, the body last. In a WITHOUT ROWID table every
    # b-tree cell holds the whole row, and a lookup compares whole records: with
    # megabyte bodies each seek (a claim's lookup, a save's upsert) read the bodies of
    # the rows it passed through their overflow chains, about 1.8 ms per claim with 100
    # stored 1 MiB responses against 0.1 ms empty. Now the key's index holds only keys,
    # and the columns before the body are read without walking its overflow pages.
    # Rows, byte totals and expiry keep their values (the copy fires no trigger).
    """
    CREATE TABLE responses_v5 (
        id          INTEGER PRIMARY KEY,
        key         TEXT NOT NULL UNIQUE,
        digest      BLOB NOT NULL,
        status      INTEGER NOT NULL,
        headers     TEXT NOT NULL,
        stored_at   REAL NOT NULL,
        expires     REAL NOT NULL,
        stored_wall REAL NOT NULL,
        scope       TEXT NOT NULL DEFAULT '',
        size        INTEGER NOT NULL DEFAULT 0,
        body        BLOB NOT NULL
    );
    INSERT INTO responses_v5
        (key, digest, status, headers, stored_at, expires, stored_wall, scope, size, body)
        SELECT key, digest, status, headers, stored_at, expires, stored_wall, scope, size, body
        FROM responses ORDER BY expires;
    DROP TABLE responses;
    ALTER TABLE responses_v5 RENAME TO responses;
    CREATE INDEX responses_expires ON responses (expires);
    """
    + _RESPONSE_BYTES_TRIGGERS,
    # 6: bodies above 64 KiB live in the side file (blobs.py); their row names the body by
    # ``blob`` and keeps an empty ``body``. ``size`` still counts the body, so quotas and
    # the byte totals are unchanged. The table is rebuilt (as by 5) to keep the body its
    # last column: ``blob`` is read by every lookup, before the body's overflow pages.
    # The partial index lists the named bodies for the side file's sweep.
    """
    CREATE TABLE responses_v6 (
        id          INTEGER PRIMARY KEY,
        key         TEXT NOT NULL UNIQUE,
        digest      BLOB NOT NULL,
        status      INTEGER NOT NULL,
        headers     TEXT NOT NULL,
        stored_at   REAL NOT NULL,
        expires     REAL NOT NULL,
        stored_wall REAL NOT NULL,
        scope       TEXT NOT NULL DEFAULT '',
        size        INTEGER NOT NULL DEFAULT 0,
        blob        INTEGER,
        body        BLOB NOT NULL
    );
    INSERT INTO responses_v6
        (id, key, digest, status, headers, stored_at, expires, stored_wall, scope, size, body)
        SELECT id, key, digest, status, headers, stored_at, expires, stored_wall, scope, size,
               body
        FROM responses;
    DROP TABLE responses;
    ALTER TABLE responses_v6 RENAME TO responses;
    CREATE INDEX responses_expires ON responses (expires);
    CREATE INDEX responses_blob ON responses (blob) WHERE blob IS NOT NULL;
    """
    + _RESPONSE_BYTES_TRIGGERS,
    # 7: the store's secret (Store.secret): 32 random bytes from the OS, hex, created once
    # with the schema, keying the digests of callers' credentials.
    """
    INSERT INTO porch_meta (name, value) VALUES ('secret', :secret);
    """,
    # 8: quotas per client identity, and reservations. A stored response names its
    # ``client`` (whatever scopes it presented), counted in ``client_bytes``; the table
    # is rebuilt (as by 5 and 6) to keep the body its last column. A claim taken under a
    # quota reserves bytes in ``reservations`` (its key, scope, client, size) until its
    # save replaces them by the response's size or its release frees them; a row left
    # by a holder that died is reclaimed once its key's lock is found free. Both tables
    # feed the same running totals, so a quota check still reads three rows. Responses
    # stored before keep the client '' (nobody's).
    """
    CREATE TABLE responses_v8 (
        id          INTEGER PRIMARY KEY,
        key         TEXT NOT NULL UNIQUE,
        digest      BLOB NOT NULL,
        status      INTEGER NOT NULL,
        headers     TEXT NOT NULL,
        stored_at   REAL NOT NULL,
        expires     REAL NOT NULL,
        stored_wall REAL NOT NULL,
        scope       TEXT NOT NULL DEFAULT '',
        client      TEXT NOT NULL DEFAULT '',
        size        INTEGER NOT NULL DEFAULT 0,
        blob        INTEGER,
        body        BLOB NOT NULL
    );
    INSERT INTO responses_v8
        (id, key, digest, status, headers, stored_at, expires, stored_wall, scope, size, blob,
         body)
        SELECT id, key, digest, status, headers, stored_at, expires, stored_wall, scope, size,
               blob, body
        FROM responses;
    DROP TABLE responses;
    ALTER TABLE responses_v8 RENAME TO responses;
    CREATE INDEX responses_expires ON responses (expires);
    CREATE INDEX responses_blob ON responses (blob) WHERE blob IS NOT NULL;
    CREATE TABLE client_bytes (
        client TEXT PRIMARY KEY,
        bytes  INTEGER NOT NULL
    ) WITHOUT ROWID;
    INSERT INTO client_bytes (client, bytes)
        SELECT client, SUM(size) FROM responses GROUP BY client;
    CREATE TABLE reservations (
        key    TEXT PRIMARY KEY,
        scope  TEXT NOT NULL,
        client TEXT NOT NULL,
        size   INTEGER NOT NULL
    ) WITHOUT ROWID;
    """
    + _BYTES_TRIGGERS_V8.format(table="responses")
    + _BYTES_TRIGGERS_V8.format(table="reservations"),
    # 9: concurrency slots (slots.py): how many requests of a key each holder (an open
    # store, alive while its byte of the lock file is locked) has in flight. Rows of
    # holders found dead are deleted; a key with none in flight has no row.
    """
    CREATE TABLE slots (
        key    TEXT NOT NULL,
        holder INTEGER NOT NULL,
        count  INTEGER NOT NULL,
        PRIMARY KEY (key, holder)
    ) WITHOUT ROWID;
    """,
    # 10: the policies (docs/design.md): each counter row's algorithm (0 fixed, 1 sliding,
    # 2 gcra; a row of another algorithm than a hit's is read as absent) and a sliding
    # window's previous count. Existing rows are fixed windows, as they were. The
    # counters view shows both.
    """
    ALTER TABLE counts ADD COLUMN previous INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE counts ADD COLUMN algorithm INTEGER NOT NULL DEFAULT 0;
    DROP TRIGGER counters_delete;
    DROP VIEW counters;
    CREATE VIEW counters
        (key, count, window_start, expires, wall_start, name, client, previous, algorithm) AS
        SELECT n.prefix || c.client, c.count, c.window_start, c.expires, c.wall_start,
               c.name, c.client, c.previous, c.algorithm
        FROM counts c JOIN counter_names n ON n.id = c.name;
    CREATE TRIGGER counters_delete INSTEAD OF DELETE ON counters BEGIN
        DELETE FROM counts WHERE name = old.name AND client = old.client;
    END;
    """,
    # 11: the reservations' bytes reach the totals through the writer (saves.Usage: once
    # per transaction, whatever number of claims it reserved for), not through triggers
    # run three and five statements per reservation inserted and deleted. The totals
    # already count every reservation in the table.
    """
    DROP TRIGGER reservations_bytes_insert;
    DROP TRIGGER reservations_bytes_delete;
    DROP TRIGGER reservations_bytes_update;
    """,
)

SCHEMA_VERSION = len(_MIGRATIONS)


def read_secret(conn: sqlite3.Connection) -> bytes:
    """The store's secret (see migration 7)."""
    (value,) = conn.execute("SELECT value FROM porch_meta WHERE name = 'secret'").fetchone()
    return bytes.fromhex(value)


def check_not_foreign(conn: sqlite3.Connection) -> None:
    """Refuse a SQLite file that holds someone else's tables, before anything writes to it.

    Runs before the file is switched to WAL (which rewrites its header): pointing
    porch at another application's database must change nothing in it.
    """
    tables = [
        name
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
    ]
    if tables and "porch_meta" not in tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(
            f"not a porch store (it holds other tables: {shown}); refusing to change it"
        )


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the file to SCHEMA_VERSION in the caller's transaction; return the old version."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the data file has schema version {version}, newer than this porch "
            f"understands ({SCHEMA_VERSION}); upgrade porch"
        )
    for number in range(version, SCHEMA_VERSION):
        for statement in statements(_MIGRATIONS[number]):
            # A migration's only parameter: a new secret (secrets, not SQLite's PRNG).
            if ":secret" in statement:
                conn.execute(statement, {"secret": token_hex(SECRET_BYTES)})
            else:
                conn.execute(statement)
    if version != SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return int(version)


def enable_incremental_vacuum(conn: sqlite3.Connection) -> bool:
    """Switch the file to ``auto_vacuum = INCREMENTAL``, so pruned pages can be given back.

    Outside any transaction, before the journal mode is set: a new (empty) file
    takes the setting as it is created. An existing file takes it only through
    one ``VACUUM`` (a rewrite of the whole file, needing as much free disk as the
    file's size), run here once; if that fails (disk full, busy) the file keeps
    working and the switch is tried at the next open. Returns whether it vacuumed.
    """
    (mode,) = conn.execute("PRAGMA auto_vacuum").fetchone()
    if mode == 2:
        return False
    (pages,) = conn.execute("PRAGMA page_count").fetchone()
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    if pages == 0:
        return False
    conn.execute("VACUUM")
    return True


def statements(script: str) -> list[str]:
    """Split a migration into statements (a trigger's body holds ``;`` of its own)."""
    found: list[str] = []
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                found.append(pending.strip())
            pending = ""
    return found


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
            "UPDATE counts SET"
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
