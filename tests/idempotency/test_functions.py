"""idempotent_function's own settings and edges (its guarantees on every backend are in
tests/store/conformance/test_functions.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from porch import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotencyPolicy,
    IntegrityError,
    KeyInProgressError,
    KeyPool,
    KeyReusedError,
    PorchMetrics,
    Quota,
    SQLiteStore,
    StoreError,
    idempotent_function,
)
from porch.idempotency import JSONCodec
from support import until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[KeyPool]:
    p = KeyPool(SQLiteStore(tmp_path))
    yield p
    await p.close()


async def test_a_result_the_codec_cannot_store_raises_and_stores_nothing(pool: KeyPool) -> None:
    results: list[Any] = [{1, 2}, [1, 2]]  # a set is no JSON

    @idempotent_function(pool, key="job")
    async def run(job: str) -> Any:
        return results.pop(0)

    with pytest.raises(TypeError):
        await run("j")
    assert await asyncio.wait_for(run("j"), 10) == [1, 2]  # the key was released
    assert await run("j") == [1, 2]
    assert results == []


async def test_keys_from_arguments_and_every_caller_gets_the_decoded_result(
    pool: KeyPool,
) -> None:
    runs: list[tuple[Any, ...]] = []

    @idempotent_function(pool)  # no key: the arguments' digest
    async def total(items: tuple[int, ...], *, tax: int = 0) -> Any:
        runs.append(items)
        return {"items": items, "total": sum(items) + tax}

    first = await total((1, 2), tax=1)
    assert first == {"items": [1, 2], "total": 4}  # as stored: a tuple comes back a list
    assert await total((1, 2), tax=1) == first
    assert await total((1, 2)) == {"items": [1, 2], "total": 3}  # other arguments, other key
    assert runs == [(1, 2), (1, 2)]
    with pytest.raises(TypeError, match="not JSON"):
        await total(({1},))  # type: ignore[arg-type]


async def test_a_custom_codec(pool: KeyPool) -> None:
    class Text(JSONCodec):
        media_type = b"text/plain"

        def encode(self, value: Any) -> bytes:
            return str(value).encode()

        def decode(self, data: bytes) -> Any:
            return data.decode()

    @idempotent_function(pool, key="n", codec=Text())
    async def square(n: int) -> Any:  # the codec makes it text
        return n * n

    assert await square(7) == "49"
    assert await square(7) == "49"


def test_configuration(tmp_path: Path) -> None:
    pool = KeyPool(SQLiteStore(tmp_path))

    async def f(x: str) -> str:
        return x

    with pytest.raises(ConfigurationError, match="pool must be a porch KeyPool"):
        idempotent_function(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="key 'y' is no parameter"):
        idempotent_function(pool, key="y")(f)
    with pytest.raises(ConfigurationError, match="policy must be an IdempotencyPolicy"):
        idempotent_function(pool, policy={"ttl": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="name must be 1-128 characters"):
        idempotent_function(pool, name="")(f)
    with pytest.raises(ConfigurationError, match="fingerprint must be 'json'"):
        idempotent_function(pool, fingerprint="bytes")(f)
    with pytest.raises(ConfigurationError, match="every cap of quota must hold max_stored"):
        idempotent_function(pool, quota=Quota(scope_bytes=1000, client_bytes=1000))
    with pytest.raises(ConfigurationError, match="an integrity_key must be at least 16"):
        idempotent_function(pool, integrity_key=b"short")
    assert idempotent_function(pool)(f).name.endswith("test_configuration.<locals>.f")


async def test_a_key_must_be_a_short_string(pool: KeyPool) -> None:
    @idempotent_function(pool, key=lambda x: x)
    async def f(x: Any) -> Any:
        return x

    for bad in ["", "x" * 256, 5]:
        with pytest.raises(ValueError, match="an idempotency key must be a str"):
            await f(bad)


async def test_no_request_reaches_a_functions_key(tmp_path: Path) -> None:
    """A function's keys start with the scoped key's separator, which the middleware
    refuses in a caller scope: no scope function can name them."""
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"http"})

    async with KeyPool(SQLiteStore(tmp_path)) as pool:

        @idempotent_function(pool, key="event", name="hooks", fingerprint=None)
        async def hook(event: str) -> str:
            return "function"

        assert await hook("e1") == "function"
        hostile = IdempotencyMiddleware(app, pool=pool, scope=lambda scope: "\x1ffn:hooks")
        transport = httpx.ASGITransport(app=hostile)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            refused = await c.post("/o", headers={"Idempotency-Key": "e1"})
        assert refused.status_code == 503
        assert refused.json()["cause"] == "configuration"
        assert calls == []
        assert await hook("e1") == "function"


async def test_a_stored_result_is_checked_before_it_is_returned(tmp_path: Path) -> None:
    """With an integrity key, a result is signed when stored; a stored result written
    without the key, or changed in the store, raises IntegrityError, never returned."""
    store = SQLiteStore(tmp_path)
    runs: list[str] = []

    async def charge(order: str) -> dict[str, str]:
        runs.append(order)
        return {"order": order, "paid": "yes"}

    async with KeyPool(store) as pool:
        signed = idempotent_function(pool, key="order", name="charge", integrity_key=b"k" * 32)
        plain = idempotent_function(pool, key="order", name="charge")
        checked, unchecked = signed(charge), plain(charge)
        assert await checked("o-1") == await checked("o-1") == {"order": "o-1", "paid": "yes"}
        assert await unchecked("o-2") == {"order": "o-2", "paid": "yes"}  # stored unsigned
        with pytest.raises(IntegrityError):
            await checked("o-2")
        # Someone with write access to the store changes the stored result.
        with sqlite3.connect(store.path) as conn:
            conn.execute(
                "UPDATE responses SET body = ? WHERE key LIKE '%o-1'",
                (b'{"order":"o-1","paid":"no"}',),
            )
        with pytest.raises(IntegrityError):
            await checked("o-1")
    assert runs == ["o-1", "o-2"]


async def test_a_signed_result_counts_its_head_and_mac_against_max_stored(
    tmp_path: Path,
) -> None:
    """The bytes a call's claim reserved hold its whole stored result (as a request's): a
    result that fits max_stored only without its key, head and MAC is not stored."""
    runs: list[int] = []

    async def blob(n: int) -> str:
        runs.append(n)
        return "x" * n

    async with KeyPool(SQLiteStore(tmp_path)) as pool:
        small = IdempotencyPolicy(max_stored=300)
        f = idempotent_function(pool, key="n", name="blob", policy=small, integrity_key=b"k" * 32)(
            blob
        )
        assert await f(100) == "x" * 100
        assert await f(100) == "x" * 100  # stored
        assert await f(290) == "x" * 290  # 290 + 2 quotes fit 300 alone, not with the rest
        assert await f(290) == "x" * 290
    assert runs == [100, 290, 290]


async def test_each_calls_outcome_and_each_wait_is_counted_per_function(tmp_path: Path) -> None:
    metrics = PorchMetrics()
    running, release = asyncio.Event(), asyncio.Event()

    async def charge(order: str, amount: int = 1) -> str:
        if order == "slow":
            running.set()
            await release.wait()
        if amount < 0:
            raise ValueError("a refund is no charge")
        return "x" * amount

    async with KeyPool(SQLiteStore(tmp_path), metrics=metrics) as pool:
        small = IdempotencyPolicy(max_stored=300, wait_timeout=10)
        f = idempotent_function(pool, key="order", name="charge", policy=small)(charge)
        conflicting = idempotent_function(
            pool,
            key="order",
            name="charge",
            policy=small.replace(concurrent="conflict"),
        )(charge)
        assert await f("o1") == "x"  # executed
        assert await f("o1") == "x"  # replayed
        with pytest.raises(KeyReusedError):
            await f("o1", 2)  # mismatch
        with pytest.raises(ValueError, match="no charge"):
            await f("o2", -1)  # failed
        assert await f("o3", 400) == "x" * 400  # unstored: over max_stored
        owner = asyncio.ensure_future(f("slow"))
        await asyncio.wait_for(running.wait(), 10)
        with pytest.raises(KeyInProgressError):
            await conflicting("slow")  # conflict, at once: no wait
        duplicate = asyncio.ensure_future(f("slow"))
        await until(
            lambda: sum(waiting for _, waiting in pool.shard_load()) == 1,
            "the duplicate waiting behind its owner",
        )
        release.set()
        assert list(await asyncio.wait_for(asyncio.gather(owner, duplicate), 10)) == ["x", "x"]

        def counted(name: str, **labels: str) -> float:
            value = metrics.registry.get_sample_value(name, {"function": "charge", **labels})
            return value or 0.0

        calls = {
            o: counted("porch_idempotent_function_calls_total", outcome=o)
            for o in (
                "executed",
                "replayed",
                "mismatch",
                "failed",
                "unstored",
                "conflict",
                "quota",
                "integrity",
                "unavailable",
            )
        }
        assert calls == {
            "executed": 2.0,  # o1, slow
            "replayed": 2.0,  # o1, the slow one's duplicate
            "mismatch": 1.0,
            "failed": 1.0,
            "unstored": 1.0,
            "conflict": 1.0,
            "quota": 0.0,
            "integrity": 0.0,
            "unavailable": 0.0,
        }
        assert counted("porch_idempotent_function_waits_total") == 1.0  # the duplicate


def test_a_sync_caller_that_stops_waiting_as_it_comes_to_own_the_key_leaves_it_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a sync call whose wait for the store ran out just as its acquire ended as
    # the owner: cancelled from the caller's thread, that answer (and the claim) was
    # dropped, and the key stayed held until the process exited (each retry: 409).
    monkeypatch.setattr("porch.idempotency._functions._LOOP_MARGIN", 0.2)
    runs: list[str] = []

    def job(job: str) -> str:
        runs.append(job)
        return job

    policy = IdempotencyPolicy(wait_timeout=1.0)
    fn = idempotent_function(KeyPool(SQLiteStore(tmp_path)), key="job", policy=policy)(job)
    owned = fn._acquire

    async def owned_late(key: str, digest: bytes) -> Any:
        answer = await owned(key, digest)
        time.sleep(2.0)  # noqa: ASYNC251 - the loop stuck, the answer in hand, past 1.2 s
        return answer

    monkeypatch.setattr(fn, "_acquire", owned_late)
    try:
        with pytest.raises(StoreError, match="no answer from the store"):
            fn("a")
        monkeypatch.setattr(fn, "_acquire", owned)
        monkeypatch.setattr("porch.idempotency._functions._LOOP_MARGIN", 60.0)
        assert fn("a") == "a"  # the key was free: run now, not refused after a wait
        assert runs == ["a"]
    finally:
        fn.close()
