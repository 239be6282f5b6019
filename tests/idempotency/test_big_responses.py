"""Responses bigger than one part, streamed to the store as they are sent and replayed from
it part by part (issue 29 item 3), on the real SQLite store: what is stored, what leaves
when, what a replay checks before and while it sends. (Memory is measured, not asserted
here: benchmarks/bigresponse.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sqlite3
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from porch import IdempotencyMiddleware, KeyPool, SQLiteStore
from porch._types import Message, Receive, Scope, Send
from porch.store.base import Parts, PartStore, Quota, Save, StoreOp
from porch.store.sqlite.blobs import blob_path
from servers import free_port
from support import spin, through_apply, until

uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.anyio

MIB = 1 << 20
CHUNK = 64 << 10
SIZE = 3 * MIB + MIB // 2  # three whole parts and a half
QUOTA = Quota(scope_bytes=64 * MIB, client_bytes=64 * MIB, total_bytes=1 << 30)
KEY = {"Idempotency-Key": "export-1"}
INTEGRITY = b"k" * 32


class Exporter:
    """An app answering 201 with ``size`` bytes of a pattern of its own per run, in 64 KiB
    chunks (``fail_after``: raises after that many bytes)."""

    def __init__(self, size: int = SIZE, fail_after: int | None = None) -> None:
        self.size = size
        self.fail_after = fail_after
        self.runs = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        self.runs += 1
        pattern = secrets.token_bytes(64) * (CHUNK // 64)
        headers = [(b"content-type", b"application/octet-stream"), (b"location", b"/e/1")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        left = self.size
        while left > 0:
            if self.fail_after is not None and self.size - left >= self.fail_after:
                raise RuntimeError("the export failed")
            piece = pattern[: min(CHUNK, left)]
            left -= len(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": left > 0})


def middleware(app: Any, pool: KeyPool, **options: Any) -> IdempotencyMiddleware:
    options.setdefault("max_stored", 8 * MIB)
    return IdempotencyMiddleware(app, pool=pool, quota=QUOTA, **options)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def side(store: SQLiteStore, sql: str, *args: object) -> list[Any]:
    with sqlite3.connect(blob_path(store.path)) as conn:
        return list(conn.execute(sql, args))


def rows(store: SQLiteStore) -> list[Any]:
    with sqlite3.connect(store.path) as conn:
        return list(conn.execute("SELECT key, blob, length(body), size FROM responses"))


def export_scope() -> Scope:
    """A POST /export with an idempotency key, for an app called directly (no client)."""
    return {
        "type": "http",
        "method": "POST",
        "path": "/export",
        "raw_path": b"/export",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k1")],
        "client": ("10.0.0.1", 1234),
    }


async def no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def test_a_big_response_is_stored_in_parts_and_replayed_byte_identically(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path)
    app = Exporter()
    async with KeyPool(store) as pool, client(middleware(app, pool)) as c:
        first = await c.post("/export", headers=KEY)
        assert (first.status_code, len(first.content)) == (201, SIZE)
        ((_, blob, body, size),) = rows(store)
        assert (blob is not None, body) == (True, 0)
        assert size > SIZE  # the whole body counts, with its key, digest and head
        parts = side(store, "SELECT seq, length(body) FROM parts WHERE blob = ?", blob)
        assert sorted(parts) == [(0, MIB), (1, MIB), (2, MIB), (3, MIB // 2)]
        for _ in range(2):
            again = await c.post("/export", headers=KEY)
            assert again.status_code == 201
            assert again.content == first.content
            assert again.headers["idempotent-replayed"] == "true"
            assert again.headers["content-length"] == str(SIZE)
            assert again.headers["content-type"] == "application/octet-stream"
            assert again.headers["location"] == "/e/1"
    assert app.runs == 1


async def test_a_duplicate_waiting_on_the_owner_gets_the_body_from_the_store(
    tmp_path: Path,
) -> None:
    app = Exporter()
    async with KeyPool(SQLiteStore(tmp_path)) as pool, client(middleware(app, pool)) as c:
        both = await asyncio.gather(*(c.post("/export", headers=KEY) for _ in range(3)))
    assert app.runs == 1
    assert len({r.content for r in both}) == 1
    assert sorted(r.headers.get("idempotent-replayed", "") for r in both) == ["", "true", "true"]


class HeldSaveStore(SQLiteStore):
    """Holds every transaction that stores a response until ``gate`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        through_apply(self)
        self.gate = asyncio.Event()
        self.held = False

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        if any(isinstance(op, Save) for op in ops):
            self.held = True
            await asyncio.wait_for(self.gate.wait(), 30)
        await super().apply(ops)


async def test_the_last_chunk_leaves_only_after_its_parts_and_record_are_committed(
    tmp_path: Path,
) -> None:
    store = HeldSaveStore(tmp_path)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = export_scope()
    async with KeyPool(store) as pool:
        app = middleware(Exporter(), pool)
        task = asyncio.ensure_future(app(scope, no_body, send))
        await until(lambda: store.held, "the response's Save reached the store")
        await spin()
        # Every part is in the side file, every chunk but the last has left.
        assert side(store, "SELECT count(*) FROM parts") == [(4,)]
        assert [m.get("more_body", False) for m in sent[1:]] == [True] * (SIZE // CHUNK - 1)
        store.gate.set()
        await asyncio.wait_for(task, 30)
    assert sent[-1]["more_body"] is False
    assert sum(len(m["body"]) for m in sent[1:]) == SIZE


async def test_a_response_past_max_stored_mid_stream_drops_its_parts_and_runs_again(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path, upkeep_after=0.05)
    app = Exporter()
    async with KeyPool(store) as pool, client(middleware(app, pool, max_stored=3 * MIB)) as c:
        first = await c.post("/export", headers=KEY)
        assert (first.status_code, len(first.content)) == (201, SIZE)  # sent all the same
        await until(lambda: side(store, "SELECT count(*) FROM parts") == [(0,)], "parts dropped")
        assert rows(store) == []
        second = await c.post("/export", headers=KEY)
        assert second.status_code == 201
        assert "idempotent-replayed" not in second.headers
    assert app.runs == 2


async def test_an_app_that_fails_mid_stream_stores_nothing(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path, upkeep_after=0.05)
    app = Exporter(fail_after=2 * MIB + CHUNK)
    async with KeyPool(store) as pool, client(middleware(app, pool)) as c:
        with pytest.raises(RuntimeError, match="the export failed"):
            await c.post("/export", headers=KEY)
        await until(lambda: side(store, "SELECT count(*) FROM parts") == [(0,)], "parts dropped")
        assert rows(store) == []
        app.fail_after = None
        again = await c.post("/export", headers=KEY)
        assert (again.status_code, len(again.content)) == (201, SIZE)
    assert app.runs == 2


class ThroughParts:
    """The store's real PartStore, every call passed through (subclasses step in)."""

    def __init__(self, inner: PartStore) -> None:
        self.inner = inner
        self.part_bytes = inner.part_bytes

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        await self.inner.write(key, body, index, data)

    async def keep(self, key: str, parts: Parts, ttl: float) -> None:
        await self.inner.keep(key, parts, ttl)

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        return await self.inner.read(key, parts, index)

    def drop(self, key: str, body: int) -> None:
        self.inner.drop(key, body)


class HeldParts(ThroughParts):
    """Part ``index``'s write waits for ``gate`` (``written`` once it is done). ``sent``:
    once asked for, that write lands even if its caller is cancelled, as a network
    store's command already on its way does."""

    def __init__(self, inner: PartStore, index: int, sent: bool = False) -> None:
        super().__init__(inner)
        self.index = index
        self.sent = sent
        self.gate = asyncio.Event()
        self.holding = False
        self.written = False
        self.dropped = False

    @classmethod
    def on(cls, store: SQLiteStore, index: int, sent: bool = False) -> HeldParts:
        """Held parts in place of ``store``'s own."""
        parts = store.capabilities.parts
        assert parts is not None
        held = cls(parts, index, sent)
        store.capabilities = replace(store.capabilities, parts=held)
        return held

    async def open_gate(self, store: SQLiteStore) -> None:
        """Let the held write land, after any drop sent before it did (as a network store's
        small DEL overtakes a big command on another connection)."""
        await spin()
        if self.dropped:
            await until(lambda: side(store, "SELECT count(*) FROM parts") == [(0,)], "drop")
        self.gate.set()
        await until(lambda: self.written, "the held part written")

    def drop(self, key: str, body: int) -> None:
        self.dropped = True
        self.inner.drop(key, body)

    async def write(self, key: str, body: int, index: int, data: bytes) -> None:
        if index != self.index:
            await self.inner.write(key, body, index, data)
        elif self.sent:
            await asyncio.shield(self._land(key, body, index, data))
        else:
            await self._land(key, body, index, data)

    async def _land(self, key: str, body: int, index: int, data: bytes) -> None:
        self.holding = True
        await asyncio.wait_for(self.gate.wait(), 30)
        await self.inner.write(key, body, index, data)
        self.written = True


async def test_a_part_still_being_written_when_the_app_fails_goes_with_the_others(
    tmp_path: Path,
) -> None:
    # The app fails while part 1 is on its way to the store: the drop must not overtake
    # it (it did, and the part stayed for its grace, ten minutes).
    store = SQLiteStore(tmp_path)
    held = HeldParts.on(store, index=1)
    app = Exporter(fail_after=2 * MIB + CHUNK)  # just after part 1's write started
    async with KeyPool(store) as pool, client(middleware(app, pool)) as c:
        with pytest.raises(RuntimeError, match="the export failed"):
            await c.post("/export", headers=KEY)
        await until(lambda: held.holding, "part 1's write reached the store")
        await held.open_gate(store)
        await until(lambda: side(store, "SELECT count(*) FROM parts") == [(0,)], "parts dropped")
        assert rows(store) == []


async def test_a_part_on_its_way_when_the_owner_is_cancelled_goes_with_the_others(
    tmp_path: Path,
) -> None:
    # The owner is cancelled (its client left) while it waits for part 1, which lands
    # all the same: the drop must wait for it, not go first.
    store = SQLiteStore(tmp_path)
    held = HeldParts.on(store, index=1, sent=True)
    scope = export_scope()

    async def send(message: Message) -> None:
        pass

    async with KeyPool(store) as pool:
        task = asyncio.ensure_future(middleware(Exporter(), pool)(scope, no_body, send))
        await until(lambda: held.holding, "part 1's write reached the store")
        await spin()  # the owner waits for it before it writes part 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        await held.open_gate(store)
        await until(lambda: side(store, "SELECT count(*) FROM parts") == [(0,)], "parts dropped")
        assert rows(store) == []


class FencedSaveStore(HeldSaveStore):
    """Holds every Save until ``gate`` is set, and sends it with a token its claim no longer
    has (as after the claim lapsed and another owner took the key): it comes back fenced."""

    async def apply(self, ops: Sequence[StoreOp]) -> None:
        for op in ops:
            if isinstance(op, Save):
                op.token += 1
        await super().apply(ops)


async def test_an_owner_cancelled_while_its_save_is_out_still_drops_what_nothing_names(
    tmp_path: Path,
) -> None:
    # The owner is cancelled (its client left) while its Save is in the store, and the
    # Save comes back fenced: no record names the body's parts, so they go now (they
    # stayed for their grace, ten minutes).
    store = FencedSaveStore(tmp_path)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async with KeyPool(store) as pool:
        app = middleware(Exporter(), pool)
        task = asyncio.ensure_future(app(export_scope(), no_body, send))
        await until(lambda: store.held, "the response's Save reached the store")
        assert side(store, "SELECT count(*) FROM parts") == [(4,)]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        store.gate.set()
        await until(lambda: side(store, "SELECT count(*) FROM parts") == [(0,)], "parts dropped")
        assert rows(store) == []


async def test_a_signed_body_in_parts_is_checked_whole_before_its_first_byte(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path)
    app = Exporter()
    async with KeyPool(store) as pool:
        async with client(middleware(app, pool, integrity_key=INTEGRITY)) as c:
            first = await c.post("/export", headers=KEY)
            again = await c.post("/export", headers=KEY)
            assert again.content == first.content
            assert "porch-mac" not in again.headers
            # Someone with write access to the store changes the middle of the body.
            with sqlite3.connect(blob_path(store.path)) as conn:
                conn.execute("UPDATE parts SET body = zeroblob(length(body)) WHERE seq = 2")
            forged = await c.post("/export", headers=KEY)
            assert forged.status_code == 503
            assert forged.json()["cause"] == "integrity"
        # A body in parts stored without the key carries no MAC: refused the same.
        async with client(middleware(app, pool)) as plain:
            stored = await plain.post("/third", headers={"Idempotency-Key": "plain"})
            assert stored.status_code == 201
        async with client(middleware(app, pool, integrity_key=INTEGRITY)) as c:
            refused = await c.post("/third", headers={"Idempotency-Key": "plain"})
            assert refused.status_code == 503
            assert refused.json()["cause"] == "integrity"
    assert app.runs == 2


class TamperingParts(ThroughParts):
    """The second time part 0 is read, another writer (a real connection to the side
    file) changes part 1: between a replay's check and its send."""

    def __init__(self, store: SQLiteStore, inner: PartStore) -> None:
        super().__init__(inner)
        self.store = store
        self.first_reads = 0

    async def read(self, key: str, parts: Parts, index: int) -> bytes | None:
        if index == 0:
            self.first_reads += 1
            if self.first_reads == 2:
                with sqlite3.connect(blob_path(self.store.path)) as conn:
                    conn.execute("UPDATE parts SET body = zeroblob(length(body)) WHERE seq = 1")
        return await self.inner.read(key, parts, index)


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="critical")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def read_into(c: httpx.AsyncClient, received: bytearray) -> None:
    async with c.stream("POST", "/export", headers=KEY) as replay:
        assert replay.status_code == 201
        assert replay.headers["content-length"] == str(SIZE)
        async for piece in replay.aiter_raw():
            received += piece


async def test_a_body_that_changes_while_it_is_replayed_never_arrives_whole(
    tmp_path: Path,
) -> None:
    # What a client sees: the head and some parts, then the connection closed short of
    # the Content-Length (its last part held back): never a complete forged response.
    store = SQLiteStore(tmp_path)
    parts = store.capabilities.parts  # the side file's
    assert parts is not None
    tampering = TamperingParts(store, parts)
    store.capabilities = replace(store.capabilities, parts=tampering)
    app = Exporter()
    async with (
        KeyPool(store) as pool,
        serve(middleware(app, pool, integrity_key=INTEGRITY)) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as c,
    ):
        first = await c.post("/export", headers=KEY)
        assert (first.status_code, len(first.content)) == (201, SIZE)
        received = bytearray()
        with pytest.raises(httpx.RemoteProtocolError):
            await read_into(c, received)
        # The parts before the changed one as stored, the last never.
        assert MIB <= len(received) <= SIZE - MIB // 2
        assert received[:MIB] == first.content[:MIB]
    assert tampering.first_reads == 2
    assert app.runs == 1
