"""Redis specifics beyond the conformance suite: scripts, pipelines, keys, pool, publishing."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio

from porch.errors import ConfigurationError
from porch.store.base import Claim, Hit, Lookup, Save, StoredResponse
from porch.store.redis import RedisStore
from servers import RedisServer, running_redis
from support import until, used

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


@pytest.fixture
def prefix() -> str:
    return f"porch-r{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    c = redis.asyncio.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
async def store(redis_url: str, prefix: str) -> AsyncIterator[RedisStore]:
    s = RedisStore(redis_url, prefix=prefix)
    await s.open()
    yield s
    await s.close()


def _rule_keys(rule: str, caller: str) -> list[str]:
    return [f"rl\x1f{rule}\x1f{limit}\x1f{caller}" for limit in ("second", "hour")]


async def test_a_whole_drain_goes_out_as_one_pipeline(
    store: RedisStore, client: redis.asyncio.Redis
) -> None:
    hits = [Hit(_rule_keys("api", f"c{i % 10}"), [100, 1000], [60.0, 3600.0]) for i in range(200)]
    lookups = [Lookup(f"scope\x1fk{i}") for i in range(20)]
    await store.apply([*hits, *lookups])
    assert store.statistics().transactions == 1
    assert store.statistics().operations == 220
    assert all(h.allowed for h in hits)
    # Counts come from the server's keys, not from the replies.
    keys = [k async for k in client.scan_iter(match=f"{store.prefix}:k:*")]
    assert len(keys) == 20
    counts = [await client.hget(k, "n") for k in keys]
    assert sorted(int(v) for v in counts if v is not None) == [20] * 20


async def test_a_rules_limits_share_one_hash_tag_and_callers_do_not(
    store: RedisStore, client: redis.asyncio.Redis
) -> None:
    await store.apply([Hit(_rule_keys("api", c), [5, 50], [1.0, 60.0]) for c in ("a", "b{x}")])
    tags: dict[str, set[str]] = {}
    async for key in client.scan_iter(match=f"{store.prefix}:k:*"):
        text = key.decode()
        tag = re.search(r"\{[0-9a-f]{16}\}", text)
        assert tag is not None, text
        assert text.index("{") == tag.start(), text
        tags.setdefault(text.rsplit("\x1f", 1)[1], set()).add(tag.group())
    assert set(tags) == {"a", "b{x}"}
    assert all(len(t) == 1 for t in tags.values())  # both limits of a caller: one slot
    assert tags["a"] != tags["b{x}"]


async def test_lost_scripts_are_loaded_again_on_noscript(
    store: RedisStore, client: redis.asyncio.Redis
) -> None:
    keys = _rule_keys("api", "flush")
    first = Hit(keys, [10, 10], [60.0, 60.0])
    await store.apply([first])
    await client.script_flush()
    assert not any(await client.script_exists(*(s.sha for s in store._scripts.values())))
    second, claim = Hit(keys, [10, 10], [60.0, 60.0]), Claim("s\x1fflush")
    await store.apply([second, claim])
    assert used(second) == [2, 2]  # ran once: the refused EVALSHA did not count
    assert claim.token > 0
    assert all(await client.script_exists(*(s.sha for s in store._scripts.values())))


async def test_decisions_are_taken_on_the_servers_clock(
    store: RedisStore, client: redis.asyncio.Redis
) -> None:
    hit = Hit(_rule_keys("api", "clock"), [5, 5], [30.0, 90.0])
    before = await client.time()
    await store.apply([hit])
    after = await client.time()
    assert before[0] + before[1] / 1e6 - 0.002 <= hit.wall <= after[0] + after[1] / 1e6 + 0.002
    assert hit.next == [30.0, 90.0]


async def test_a_busy_pool_makes_callers_wait_instead_of_failing(
    redis_url: str, prefix: str, client: redis.asyncio.Redis
) -> None:
    store = RedisStore(redis_url, prefix=prefix, max_connections=2)
    await store.open()
    try:
        hits = [Hit([f"busy{i % 3}"], [1000], [60.0]) for i in range(60)]
        await asyncio.gather(*(store.apply([h]) for h in hits))
        assert all(h.allowed for h in hits)
        assert store.statistics().failures == 0
    finally:
        await store.close()
    values = [await client.hget(store.names.counter(f"busy{i}"), "n") for i in range(3)]
    assert sorted(int(v) for v in values if v is not None) == [20, 20, 20]


@pytest.mark.parametrize("appendfsync", ["everysec", "always"])
async def test_a_server_killed_and_restarted_with_aof_keeps_counts(appendfsync: str) -> None:
    with running_redis(appendonly=True, appendfsync=appendfsync) as server:
        store = RedisStore(server.url, prefix="aof")
        await store.open()
        keys = _rule_keys("api", "aof")
        hits = [Hit(keys, [10, 10], [3600.0, 3600.0]) for _ in range(7)]
        try:
            await store.apply(hits)
            if appendfsync == "everysec":
                # With everysec, Redis holds acknowledged writes in its AOF buffer (up to
                # ~2 s) while a background fsync is slow; a kill -9 then loses them. Once
                # the buffer is written to the file, the page cache outlives the process.
                await until(lambda: aof_buffered(server) == 0, "the AOF buffer written")
            server.stop(kill=True)  # kill -9: only what is in the AOF file survives
            server.start()
            after = Hit(keys, [10, 10], [3600.0, 3600.0])
            deadline = asyncio.get_running_loop().time() + 20
            while True:  # the pool reconnects by itself
                try:
                    await store.apply([after])
                    break
                except Exception:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.1)
            assert used(after) == [8, 8]
        finally:
            await store.close()


def test_settings_are_validated_with_exact_messages() -> None:
    url = "redis://127.0.0.1:1/0"
    cases: dict[str, dict[str, Any]] = {
        "a Redis store URL starts with redis://, rediss:// or unix://, got 'postgresql'": dict(
            url="postgresql://x/y"
        ),
        "prefix must be non-empty without braces, got 'a{b}'": dict(prefix="a{b}"),
        "lease must be > 0 seconds, got 0": dict(lease=0),
        "timeout must be > 0 seconds, got -1": dict(timeout=-1),
        "max_connections must be >= 2, got 1": dict(max_connections=1),
        "in_flight must be 1-16, got 17": dict(in_flight=17),
    }
    for message, options in cases.items():
        target = str(options.pop("url", url))
        with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
            RedisStore(target, **options)


def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(ConfigurationError, match=re.escape("pip install 'porch[redis]'")):
        RedisStore("redis://127.0.0.1:1/0")


async def test_only_a_claim_someone_found_held_publishes_a_wake_up(
    store: RedisStore, client: redis.asyncio.Redis
) -> None:
    pubsub = client.pubsub()
    await pubsub.subscribe(store.names.channel)
    try:
        assert (await pubsub.get_message(timeout=5.0) or {}).get("type") == "subscribe"
        response = StoredResponse(b"d", 201, (), b"ok")
        alone = Claim("s\x1falone")
        await store.apply([alone])
        await store.apply([Save(alone.key, response, 60, token=alone.token)])
        contended, waiter = Claim("s\x1fwaited"), Claim("s\x1fwaited")
        await store.apply([contended])
        await store.apply([waiter])
        assert waiter.held
        await store.apply([Save(contended.key, response, 60, token=contended.token)])
        messages = []
        while (message := await pubsub.get_message(timeout=1.0)) is not None:
            messages.append(message["data"])
        assert messages == [b"s\x1fwaited"]
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]


def aof_buffered(server: RedisServer) -> int:
    """Bytes of acknowledged writes Redis has not yet written to its AOF file."""
    info = subprocess.run(
        ["redis-cli", "-p", str(server.port), "info", "persistence"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    for line in info.splitlines():
        if line.startswith("aof_buffer_length:"):
            return int(line.split(":", 1)[1])
    raise AssertionError(f"no aof_buffer_length in INFO persistence: {info!r}")


async def test_a_holder_whose_lease_lapsed_with_nobody_taking_the_key_still_saves(
    store: RedisStore, client: redis.asyncio.Redis
) -> None:
    """A heartbeat late past the lease (a loaded machine), and no other claim meanwhile:
    the holder still owns the key and its save is stored, so a duplicate replays it. The
    record outlives its lease; it was gone with it, that save was fenced and the next
    duplicate ran the handler again (seen in a loaded run of the two-host webhook gate).
    Another claim taken during the lapse still fences the late holder."""
    response = StoredResponse(b"d", 200, (), b"once")
    lease_ms = int(store.lease * 1000)
    late, taken = Claim("s\x1flate"), Claim("s\x1ftaken")
    await store.apply([late, taken])
    for claim in (late, taken):
        record = store.names.record(claim.key)
        assert await client.pttl(record) > lease_ms  # kept past its lease
        # The lease lapsed with no renewal: its end in the server's past.
        await client.hset(record, "l", 0)
    rival = Claim(taken.key)
    await store.apply([rival])
    assert rival.token > taken.token
    late_save = Save(late.key, response, 60, token=late.token)
    fenced_save = Save(taken.key, response, 60, token=taken.token)
    await store.apply([late_save, fenced_save])
    assert (late_save.outcome, fenced_save.outcome) == ("saved", "fenced")
    duplicate = Claim(late.key)
    await store.apply([duplicate])
    assert duplicate.stored == response
