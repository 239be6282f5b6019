"""The lone hit's lean path (counters.apply_lone_hit): the rows and verdicts of the batch path."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from porch.store.base import Hit
from porch.store.sqlite.counters import apply_counters, apply_lone_hit
from porch.store.sqlite.schema import migrate


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    migrate(conn)
    conn.execute("COMMIT")
    return conn


def table(conn: sqlite3.Connection) -> list[tuple[object, ...]]:
    return sorted(
        conn.execute(
            "SELECT prefix, client, count, window_start, expires, wall_start, previous, algorithm"
            " FROM counts JOIN counter_names ON counter_names.id = counts.name"
        )
    )


def verdict(hit: Hit) -> tuple[object, ...]:
    return (
        hit.allowed,
        hit.fits,
        hit.remaining,
        hit.next,
        hit.full,
        hit.retry,
        hit.stamp,
        hit.wall,
    )


def test_a_lone_hit_writes_the_rows_and_verdict_of_a_batch(tmp_path: Path) -> None:
    lean, batch = connect(tmp_path / "lean.sqlite3"), connect(tmp_path / "batch.sqlite3")
    known_lean: dict[str, int] = {}
    known_batch: dict[str, int] = {}
    rng = random.Random(14)
    # Porch's keys (rl US rule US limit US client) and bare ones; limits of 0 (every hit
    # refused, nothing written), 1 and 3; costs of 0 to 4; windows that elapse between hits.
    keys = ["rl\x1fr\x1f0\x1fa", "rl\x1fr\x1f0\x1fb", "rl\x1fs\x1f1\x1fa", "k", "\x1fodd"]
    now, wall = 1000.0, 1_700_000_000.0
    for step in range(600):
        key = rng.choice(keys)
        amount, window = rng.choice([0, 1, 3, 3]), rng.choice([1.0, 5.0])
        now += rng.choice([0.0, 0.25, 1.5])
        wall += 0.5
        cost = rng.choice([0, 1, 1, 1, 2, 4])
        one = Hit([key], [amount], [window], cost=cost)
        many = Hit([key], [amount], [window], cost=cost)
        for conn in (lean, batch):
            conn.execute("BEGIN IMMEDIATE")
        created = apply_lone_hit(lean, one, now, wall, known_lean)
        assert created == apply_counters(batch, [many], now, wall, known_batch), step
        for conn in (lean, batch):
            conn.execute("COMMIT")
        assert verdict(one) == verdict(many), step
        assert table(lean) == table(batch), step
    assert known_lean == known_batch
    lean.close()
    batch.close()
