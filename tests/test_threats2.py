"""The second security review's findings (issue 26, THREATS.md), in process: each test
fails on the code before its fix. The same findings against real processes are in
tests/e2e/test_gate_threats.py."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from porch import (
    CallerScope,
    ClientIdentity,
    IdempotencyMiddleware,
    KeyPool,
    ManualClock,
    SQLiteStore,
)
from porch._types import Message, Receive, Scope, Send
from porch.idempotency._integrity import MAC_HEADER, IntegrityKeys
from porch.idempotency._keys import request_digest
from porch.store.base import Lookup, Save, StoredResponse

pytestmark = pytest.mark.anyio


class Orders:
    """An app that counts executions."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": f"order {self.calls}".encode()})


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[KeyPool]:
    p = KeyPool(SQLiteStore(tmp_path, clock=ManualClock()), size=2)
    yield p
    await p.close()


async def request(
    app: IdempotencyMiddleware,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One keyed POST through ``app`` from ``client`` (None: a unix socket)."""
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": "/orders",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"order-1"), *headers],
        "client": client,
    }
    inbox: list[Message] = [{"type": "http.request", "body": b"tea", "more_body": False}]
    sent: list[Message] = []

    async def receive() -> Message:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], dict(sent[0]["headers"]), body


# --- finding 2: no peer, no shared scope ---------------------------------------------------


async def test_callers_without_an_address_never_share_a_scope(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: with no client address (a unix-socket proxy not named in trusted_proxies)
    # every anonymous caller shared one scope: the second got the first's stored order.
    caplog.set_level(logging.WARNING, "porch.idempotency")
    orders = Orders()
    app = IdempotencyMiddleware(orders, pool=pool)
    answers = [await request(app, [], None) for _ in range(3)]
    for status, headers, body in answers:
        assert status == 503
        assert json.loads(body)["cause"] == "unidentified"
        assert b"idempotent-replayed" not in headers
    assert orders.calls == 0
    advice = [r for r in caplog.records if "trusted_proxies=['unix']" in r.getMessage()]
    assert len(advice) == 1  # said once, not per request
    # Credentials are a scope of their own, with or without an address.
    first = await request(app, [(b"cookie", b"s=carol")], None)
    second = await request(app, [(b"cookie", b"s=dave")], None)
    assert first[0] == second[0] == 201
    assert first[2] != second[2]
    assert orders.calls == 2


async def test_a_trusted_unix_socket_proxy_names_each_caller(pool: KeyPool) -> None:
    orders = Orders()
    identity = ClientIdentity(trusted_proxies=["unix"])
    app = IdempotencyMiddleware(orders, pool=pool, scope=CallerScope(identity=identity))
    alice = await request(app, [(b"x-forwarded-for", b"203.0.113.1")], None)
    bob = await request(app, [(b"x-forwarded-for", b"203.0.113.2")], None)
    replay = await request(app, [(b"x-forwarded-for", b"203.0.113.1")], None)
    assert alice[0] == bob[0] == 201
    assert alice[2] != bob[2]
    assert replay[1][b"idempotent-replayed"] == b"true"
    assert replay[2] == alice[2]


def test_an_empty_peer_address_is_no_address() -> None:
    from porch.errors import UnidentifiedCallerError

    scope = CallerScope()
    for client in (None, ("", 0)):
        with pytest.raises(UnidentifiedCallerError):
            scope({"type": "http", "headers": [], "client": client})
    assert scope({"type": "http", "headers": [], "client": ("10.0.0.1", 1)}) == "client:10.0.0.1"


# --- finding 4: credential digests keyed with the store's secret ---------------------------

WORDS = ("hunter2", "password", "letmein")


def unkeyed_scope(authorization: bytes) -> str:
    """The scope CallerScope gave before the fix: an unkeyed digest of the header."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"a %d:" % len(authorization))
    h.update(authorization)
    return "cred:" + h.hexdigest()


def basic(user: str, password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{password}".encode())


async def test_a_stored_scope_cannot_be_tested_against_a_dictionary(
    pool: KeyPool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: porch inspect, the store and the logs showed "cred:" + an unkeyed digest of
    # Authorization, and a Basic-auth password was recovered with a three-word dictionary.
    caplog.set_level(logging.INFO, "porch.idempotency")
    app = IdempotencyMiddleware(Orders(), pool=pool)
    auth = [(b"authorization", basic("alice", "hunter2"))]
    assert (await request(app, auth, ("10.0.0.1", 1)))[0] == 201
    mismatch = await request(app, [*auth, (b"content-type", b"x/y")], ("10.0.0.1", 1))
    assert mismatch[0] == 422  # logged with its scope
    with sqlite3.connect(tmp_path / "porch.sqlite3") as conn:
        [(stored,)] = conn.execute("SELECT scope FROM responses").fetchall()
        (secret,) = conn.execute("SELECT value FROM porch_meta WHERE name = 'secret'").fetchone()
    conn.close()
    logged = {getattr(r, "scope", None) for r in caplog.records}
    assert stored in logged
    guesses = {unkeyed_scope(basic("alice", word)) for word in WORDS}
    assert stored not in guesses
    # It is the digest keyed with this store's secret, which only the store holds.
    h = hashlib.blake2b(digest_size=16, key=bytes.fromhex(secret))
    h.update(b"a %d:" % len(auth[0][1]))
    h.update(auth[0][1])
    assert stored == "cred:" + h.hexdigest()


# --- finding 8: stored responses are replayed as read -------------------------------------


async def forge(pool: KeyPool, key: str, headers: tuple[tuple[bytes, bytes], ...]) -> None:
    """What anyone with write access to the store can do: put a response under a key."""
    forged = StoredResponse(request_digest_of_tea(), 201, headers, b"pay here")
    await pool.store.apply([Save(key, forged, 600.0)])


def request_digest_of_tea() -> bytes:
    return request_digest("POST", "/orders", b"", b"tea", [(b"content-type", [])])


async def test_a_forged_record_never_replays_headers_outside_the_allow_list(
    pool: KeyPool,
) -> None:
    # Catches: stored headers were replayed as read, Set-Cookie included (finding 8).
    app = IdempotencyMiddleware(Orders(), pool=pool)
    await pool.start()
    await forge(
        pool,
        "client:10.0.0.1\x1forder-1",
        ((b"set-cookie", b"session=attacker"), (b"location", b"/orders/1")),
    )
    status, headers, body = await request(app, [], ("10.0.0.1", 1))
    assert (status, body) == (201, b"pay here")  # without a key, a write is a replay
    assert headers[b"idempotent-replayed"] == b"true"
    assert b"set-cookie" not in headers
    assert headers[b"location"] == b"/orders/1"


async def test_with_an_integrity_key_a_forged_record_is_not_replayed(
    pool: KeyPool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "porch.idempotency")
    orders = Orders()
    app = IdempotencyMiddleware(orders, pool=pool, integrity_key=b"k" * 32)
    first = await request(app, [], ("10.0.0.1", 1))
    again = await request(app, [], ("10.0.0.1", 1))
    assert first[0] == 201
    assert again[1][b"idempotent-replayed"] == b"true"
    assert again[2] == first[2]
    assert MAC_HEADER not in again[1]  # the MAC is stored, never sent
    # A record written without the key: refused, not replayed, logged, the handler not run.
    await forge(pool, "client:10.0.0.2\x1forder-1", ((b"location", b"https://evil.example/"),))
    status, headers, body = await request(app, [], ("10.0.0.2", 1))
    assert status == 503
    assert json.loads(body)["cause"] == "integrity"
    assert b"location" not in headers
    assert orders.calls == 1
    assert any("integrity check" in r.getMessage() for r in caplog.records)
    # A genuine record moved under another caller's key fails too (the key is signed).
    moved = Lookup("client:10.0.0.1\x1forder-1")
    await pool.store.apply([moved])
    assert moved.result is not None
    await pool.store.apply([Save("client:10.0.0.3\x1forder-1", moved.result, 600.0)])
    assert (await request(app, [], ("10.0.0.3", 1)))[0] == 503
    # A new key rolls out: records signed with the old one still verify.
    rolled = IdempotencyMiddleware(orders, pool=pool, integrity_key=[b"n" * 32, b"k" * 32])
    assert (await request(rolled, [], ("10.0.0.1", 1)))[2] == first[2]


def test_an_integrity_key_is_long_enough() -> None:
    from porch.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="at least 16 random bytes"):
        IntegrityKeys(b"short")
    with pytest.raises(ConfigurationError, match="at least one key"):
        IntegrityKeys([])
